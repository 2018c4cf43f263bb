"""Training DFlash drafters: `core` (recipe + small in-memory trainer), `pipeline` (real data)."""

from sgl_dflash.train.core import TrainingDataError, build_draft_config, train_drafter

__all__ = ["TrainingDataError", "build_draft_config", "train_drafter"]
