"""`python -m sgl_dflash.datasets`, and the names `python -m sgl_dflash.train` reads here; the code
lives in sgl_dflash/tools/datasets.py."""

from sgl_dflash.tools.datasets import load_training_prompts, main  # noqa: F401

if __name__ == "__main__":
    main()
