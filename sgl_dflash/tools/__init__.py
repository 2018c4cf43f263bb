"""Tooling around the runtime: the demo, benchmarks, prompt sets, model import, the tiny pair and
drafter training (tools/train/). The runtime never imports it."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Converted models, prompt sets, the tiny pair and the JAX compilation cache.
CACHE_DIR = Path(os.environ.get("SGL_DFLASH_CACHE", REPO_ROOT / "cache"))
# The benchmarks' --speculative-token-map, which follows the server's flag.
TOKEN_MAP_HELP = ("the drafter's hot-token map (JSON ids); default: the one its config.json names, if any; "
                  "'none': the whole vocabulary")


def save_figure(fig, path: Path) -> Path:
    """A benchmark's matplotlib figure, laid out, written to `path` (PNG at 120 dpi) and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
