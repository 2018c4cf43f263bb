"""`python -m sgl_dflash.demo`: the command users know; the code lives in sgl_dflash/tools/demo.py."""

from sgl_dflash.tools.demo import main

if __name__ == "__main__":
    main()
