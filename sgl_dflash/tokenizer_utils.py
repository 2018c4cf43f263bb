"""Tokenizer loading, EOS ids and detokenization."""

from __future__ import annotations

import json
import os
from typing import Any


class TokenizerLoadError(ValueError):
    pass


def get_tokenizer(path: str) -> Any:
    """A transformers tokenizer from a model or tokenizer directory (no hub access)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError)
        raise TokenizerLoadError(
            f"could not load a tokenizer from {path!r} ({type(e).__name__}: {e}); pass "
            "--tokenizer-path, or --skip-tokenizer-init to send token ids"
        ) from e


def eos_token_ids(model_path: str, tokenizer: Any | None = None) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (their union)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_path, name)
        if os.path.isfile(path):
            with open(path) as f:
                ids |= _as_id_set(json.load(f).get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def detokenize(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)
