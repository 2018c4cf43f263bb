"""Training DFlash drafters: `responses` (the kept data set), `regenerate` (grow it with our Engine),
`trainer` (features on the fly, CUDA or CPU), `core` (the recipe's pieces)."""

from sgl_dflash.tools.train.core import TrainingDataError, build_draft_config
from sgl_dflash.tools.train.trainer import train_drafter

__all__ = ["TrainingDataError", "build_draft_config", "train_drafter"]
