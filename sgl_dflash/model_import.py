"""`python -m sgl_dflash.model_import`, and the names `python -m sgl_dflash.train` reads here; the
code lives in sgl_dflash/tools/model_import.py."""

from sgl_dflash.tools.model_import import CACHE_DIR, ensure_default_model, main  # noqa: F401

if __name__ == "__main__":
    main()
