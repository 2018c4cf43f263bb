"""`python -m sgl_dflash.bench`: the command users know; the code lives in sgl_dflash/tools/bench.py."""

from sgl_dflash.tools.bench import main

if __name__ == "__main__":
    main()
