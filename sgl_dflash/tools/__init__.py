"""Tooling around the runtime: the demo, benchmarks, prompt sets, model import and the tiny pair.
The runtime never imports it. (Drafter training lives in sgl_dflash/train/.)"""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Converted models, prompt sets, the tiny pair and the JAX compilation cache.
CACHE_DIR = Path(os.environ.get("SGL_DFLASH_CACHE", REPO_ROOT / "cache"))
