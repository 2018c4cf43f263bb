"""`python -m sgl_dflash.train`: the command users know; the code lives in sgl_dflash/tools/train/.

The names a script needs to train a drafter in memory are re-exported here.
"""

from sgl_dflash.tools.train import TrainingDataError, build_draft_config, train_drafter  # noqa: F401
from sgl_dflash.tools.train.__main__ import main

if __name__ == "__main__":
    main()
