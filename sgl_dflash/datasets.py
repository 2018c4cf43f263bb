"""`python -m sgl_dflash.datasets`: the command users know; the code lives in sgl_dflash/tools/datasets.py."""

from sgl_dflash.tools.datasets import main

if __name__ == "__main__":
    main()
