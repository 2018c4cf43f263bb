"""The DFlash drafter: one PyTorch module, run eagerly or lowered to JAX through torchax.

`DFlashProposer` (the torchax-jitted runtime state machine) is imported on first use: plain torch
users (eager drafting, training on CUDA) never import torchax, which registers a `jax` device
that torch's autograd does not expect on some builds.
"""

from .config import DFlashConfig, DraftCheckpointError, DrafterStateError, default_target_layer_ids
from .loader import load_draft_model, read_draft_config
from .model import DFlashDraftModel
from .torch_drafter import TorchDrafter

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashProposer",
    "DraftCheckpointError",
    "DrafterStateError",
    "TorchDrafter",
    "default_target_layer_ids",
    "load_draft_model",
    "read_draft_config",
]


def __getattr__(name: str):
    if name == "DFlashProposer":
        from .proposer import DFlashProposer

        return DFlashProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
