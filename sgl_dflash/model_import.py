"""`python -m sgl_dflash.model_import`: the command users know; the code lives in
sgl_dflash/tools/model_import.py."""

from sgl_dflash.tools.model_import import main

if __name__ == "__main__":
    main()
