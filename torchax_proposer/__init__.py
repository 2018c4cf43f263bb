"""The DFlash drafter: one PyTorch module, run eagerly or lowered to JAX through torchax."""

from .config import DFlashConfig, DraftCheckpointError, DrafterStateError, default_target_layer_ids
from .dflash2 import DFlash2DraftModel, build_draft_model
from .dflash2_jax import dense_draft_probs
from .loader import load_draft_model, read_draft_config
from .model import DFlashDraftModel
from .proposer import DFlashProposer, DraftPath
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
