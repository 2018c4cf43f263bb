"""The DFlash drafter: one PyTorch module, run eagerly or lowered to JAX through torchax.

`DFlashProposer` (the torchax-jitted runtime state machine) and the JAX helpers are imported on
first use: plain torch users (eager drafting, training on CUDA) never import torchax, which
registers a `jax` device that torch's autograd does not expect on some builds.
"""

from .config import DFlashConfig, DraftCheckpointError, DrafterStateError, default_target_layer_ids
from .dflash2 import DFlash2DraftModel, build_draft_model
from .loader import load_draft_model, read_draft_config
from .model import DFlashDraftModel
from .torch_drafter import TorchDrafter

__all__ = [
    "DFlash2DraftModel",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashProposer",
    "DraftCheckpointError",
    "DraftPath",
    "DrafterStateError",
    "TorchDrafter",
    "build_draft_model",
    "default_target_layer_ids",
    "dense_draft_probs",
    "load_draft_model",
    "read_draft_config",
]


def __getattr__(name: str):
    if name in ("DFlashProposer", "DraftPath"):
        from . import proposer

        return getattr(proposer, name)
    if name == "dense_draft_probs":
        from .dflash2_jax import dense_draft_probs

        return dense_draft_probs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
