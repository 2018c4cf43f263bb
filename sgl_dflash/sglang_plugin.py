"""The module pyproject.toml's `sglang.srt.plugins` entry point names (`dflash_jax =
sgl_dflash.sglang_plugin:register`), kept at this SGLang-facing path; the code lives in
sgl_dflash/integrations/sglang_plugin.py."""

from sgl_dflash.integrations.sglang_plugin import register  # noqa: F401
