"""Tokenizer loading (no hub access)."""

from __future__ import annotations

from typing import Any

from sgl_dflash.errors import ServerArgsError


def get_tokenizer(path: str) -> Any:
    """A transformers tokenizer from a model or tokenizer directory (no hub access)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError)
        raise ServerArgsError(
            f"could not load a tokenizer from {path!r} ({type(e).__name__}: {e}); pass "
            "--tokenizer-path, or --skip-tokenizer-init to send token ids"
        ) from e
