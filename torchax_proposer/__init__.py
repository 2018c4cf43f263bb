"""The DFlash drafter: one PyTorch module, run eagerly or lowered to JAX through torchax."""

from .config import DFlashConfig, DraftCheckpointError, DrafterStateError, default_target_layer_ids
from .loader import load_draft_model, read_draft_config
from .model import DFlashDraftModel
from .proposer import DFlashProposer
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
