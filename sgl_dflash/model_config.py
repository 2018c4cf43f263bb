"""The one place the runtime reads a model directory's JSON files (config.json,
generation_config.json); errors name the flag that pointed there.

jax_backend parses the target's config fully when it loads the weights (`TargetConfig`) and
torchax_proposer parses the drafter's (`read_draft_config`); the runtime only needs a few keys
before loading anything: for argument checks, for the drafter-fits-target check, and EOS ids.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sgl_dflash.errors import ServerArgsError


def read_model_config(model_dir: str | None, flag: str) -> dict[str, Any]:
    """config.json of a model directory, with an error naming the flag when it is missing."""
    if not model_dir:
        raise ServerArgsError(f"{flag} is required")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ServerArgsError(f"{flag} {model_dir!r}: no config.json there")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ServerArgsError(f"{flag} {model_dir!r}: config.json is not valid JSON ({e})") from None


def target_dims(model_dir: str) -> dict[str, Any]:
    """The target's sizes a drafter is checked against (torchax_proposer's `target_config` dict)."""
    config = read_model_config(model_dir, "--model-path")
    try:
        return {key: config[key] for key in ("hidden_size", "vocab_size", "num_hidden_layers")}
    except KeyError as e:
        raise ServerArgsError(f"--model-path {model_dir!r}: config.json has no {e.args[0]!r}") from None


def eos_token_ids(model_dir: str, tokenizer: Any | None = None) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer (their union)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
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
