"""`DFlashConfig`: the z-lab drafter config.json (a Qwen3 config plus a `dflash_config` block).

The Qwen3 keys are parsed by transformers' own `Qwen3Config`, so that every default (head_dim,
rope, layer types, ...) is exactly the one the z-lab reference sees. DFlash keys are read from
`dflash_config` first, then from the top level, like the reference does.

Two architectures share this config: `DFlashDraftModel` (DFlash 1) and `DFlash2DraftModel`
(DFlash 2), which adds `conv_kernel_size`, `conv_group_size`, `selector_rank` and
`selector_top_k` (all required for it; see torchax_proposer/dflash2.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


class DraftCheckpointError(ValueError):
    """A drafter checkpoint that cannot be served: the message names the file, key or tensor."""


class DrafterStateError(ValueError):
    """A drafter call that does not fit the sequences' state (unknown id, wrong lengths, capacity)."""


DEFAULT_BLOCK_SIZE = 16
DFLASH1, DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# RoPE variants whose frequencies change with the sequence length: the drafter's static JAX
# cache has no place for that, so they are refused instead of served wrongly.
_UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule: one layer -> the middle one; else evenly spread over layers 1 .. n-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + i * (last - first) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    hidden_act: str
    rms_norm_eps: float
    attention_bias: bool
    rope_type: str
    # Per draft layer: (is_causal, sliding_window or None), as the reference derives them.
    layer_attention: tuple[tuple[bool, int | None], ...]
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    hf_config: Any = field(repr=False, compare=False)
    architecture: str = DFLASH1
    # DFlash 2 only (None for DFlash 1): the convolutions' taps and channels per group, the
    # selector's codebook rank and its number of candidates per draft position.
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == DFLASH2

    @property
    def num_context_features(self) -> int:
        """Width of the context features the drafter consumes: one hidden state per target layer."""
        return len(self.target_layer_ids) * self.hidden_size

    def prior_acceptance(self, block_size: int) -> np.ndarray | None:
        """What a request's drafts are taken to accept before any was read (the adaptive policy's
        prior): `unseen_acceptance` where the config records it, else `held_out_acceptance`."""
        unseen = self.unseen_acceptance(block_size)
        return unseen if unseen is not None else self.held_out_acceptance(block_size)

    def unseen_acceptance(self, block_size: int) -> np.ndarray | None:
        """As `held_out_acceptance`, from `training.unseen`: greedy drafts on benchmark prompts the
        drafter never trained on (`python -m sgl_dflash.tools.unseen_acceptance --write`)."""
        return self._measured_acceptance("unseen", block_size)

    def held_out_acceptance(self, block_size: int) -> np.ndarray | None:
        """[block_size - 1] the drafter's measured acceptance of draft i given that the drafts
        before it passed, from the held-out evaluation its training wrote into config.json
        (`training.held_out.B<b>.accept_rate_per_position`: the fraction of blocks of b that
        accepted at least i drafts) at the largest block b <= `block_size` measured; positions past
        it count as never accepted (none was measured there). None where the checkpoint has no such
        list (a z-lab one) or what it has is not one."""
        return self._measured_acceptance("held_out", block_size)

    def _measured_acceptance(self, section: str, block_size: int) -> np.ndarray | None:
        training = self.raw.get("training")
        held_out = training.get(section) if isinstance(training, dict) else None
        keys = held_out if isinstance(held_out, dict) else {}
        blocks = [int(k[1:]) for k in keys if k[:1] == "B" and k[1:].isdigit()]
        measured = max((b for b in blocks if 2 <= b <= block_size), default=None)
        if measured is None or not isinstance(held_out[f"B{measured}"], dict):
            return None
        try:
            rates = np.asarray(held_out[f"B{measured}"].get("accept_rate_per_position"), np.float64)
        except (TypeError, ValueError):
            return None
        if rates.shape != (measured - 1,) or not np.all((rates >= 0) & (rates <= 1)) or np.any(np.diff(rates) > 0):
            return None
        before = np.concatenate([[1.0], rates[:-1]])
        passed = np.divide(rates, before, out=np.zeros_like(rates), where=before > 0)
        return np.pad(passed, (0, block_size - measured))

    def check_token_map(self, token_map: Any) -> np.ndarray:
        """A hot-token map's ids (int64 [K]), or ValueError naming what is wrong with it."""
        ids = np.asarray(token_map, np.int64).reshape(-1)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= self.vocab_size or len(np.unique(ids)) != ids.size:
            raise ValueError(f"token_map must hold distinct token ids in [0, {self.vocab_size})")
        # DFlash 2: the selector's candidates are the top-K of the mapped logits, mapped back to
        # token ids (its codebooks cover the whole vocabulary), so the map needs K ids.
        if self.is_dflash2 and ids.size < self.selector_top_k:
            raise ValueError(
                f"token_map has {ids.size} ids, fewer than the DFlash 2 selector's "
                f"selector_top_k={self.selector_top_k} (its candidates come from the map)"
            )
        return ids

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, num_target_layers: int | None = None) -> "DFlashConfig":
        """Parses a z-lab config dict. `num_target_layers` is the fallback used for the default
        `target_layer_ids` when the config names neither the ids nor `num_target_layers`."""
        from transformers import Qwen3Config

        if not isinstance(raw, dict):
            raise DraftCheckpointError(f"drafter config must be a JSON object, got {type(raw).__name__}")
        architecture = _architecture(raw.get("architectures"))
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if key not in raw:
                raise DraftCheckpointError(f"drafter config is missing the key {key!r}")
        try:
            hf = Qwen3Config.from_dict(raw)
        except Exception as err:  # transformers validates types and values in many ways
            raise DraftCheckpointError(f"drafter config is malformed: {err}") from err

        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise DraftCheckpointError("drafter config key 'dflash_config' must be a JSON object")

        def value(name: str, default: Any = None) -> Any:
            return dflash.get(name, raw.get(name, default))

        hidden_size = _positive_int(hf.hidden_size, "hidden_size")
        num_layers = _positive_int(hf.num_hidden_layers, "num_hidden_layers")
        num_heads = _positive_int(hf.num_attention_heads, "num_attention_heads")
        num_kv_heads = _positive_int(hf.num_key_value_heads, "num_key_value_heads")
        if num_heads % num_kv_heads:
            raise DraftCheckpointError(
                f"drafter num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )

        mask_token_id = value("mask_token_id")
        if mask_token_id is None:
            raise DraftCheckpointError("drafter config has no 'mask_token_id' (in dflash_config or top level)")
        mask_token_id = _int(mask_token_id, "mask_token_id")

        config_target_layers = value("num_target_layers")
        if config_target_layers is not None:
            config_target_layers = _positive_int(config_target_layers, "num_target_layers")
        ids = value("target_layer_ids")
        if ids is None:
            layers_for_default = config_target_layers or num_target_layers
            if layers_for_default is None:
                raise DraftCheckpointError(
                    "drafter config names neither 'target_layer_ids' nor 'num_target_layers'"
                )
            ids = default_target_layer_ids(layers_for_default, num_layers)
        if not isinstance(ids, (list, tuple)) or not ids:
            raise DraftCheckpointError(f"drafter 'target_layer_ids' must be a non-empty list, got {ids!r}")
        ids = tuple(_int(i, "target_layer_ids") for i in ids)

        softcap = value("final_logit_softcapping")
        rope_type = hf.rope_parameters.get("rope_type", "default")
        if rope_type in _UNSUPPORTED_ROPE_TYPES:
            raise DraftCheckpointError(f"drafter rope_type={rope_type!r} is not supported")
        if hf.rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
            raise DraftCheckpointError("drafter partial_rotary_factor != 1 is not supported")

        block_size = _positive_int(value("block_size", DEFAULT_BLOCK_SIZE), "block_size")
        vocab_size = _positive_int(hf.vocab_size, "vocab_size")
        dflash2 = _dflash2_values(value, hidden_size, vocab_size, block_size) if architecture == DFLASH2 else {}

        return cls(
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=_positive_int(hf.head_dim, "head_dim"),
            intermediate_size=_positive_int(hf.intermediate_size, "intermediate_size"),
            vocab_size=vocab_size,
            hidden_act=str(hf.hidden_act),
            rms_norm_eps=float(hf.rms_norm_eps),
            attention_bias=bool(hf.attention_bias),
            rope_type=rope_type,
            layer_attention=tuple(_layer_attention(hf, raw, i) for i in range(num_layers)),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=ids,
            num_target_layers=config_target_layers,
            input_embedding_scale=_float(value("input_embedding_scale", 1.0), "input_embedding_scale"),
            output_multiplier=_float(value("output_multiplier", 1.0), "output_multiplier"),
            final_logit_softcapping=None if softcap is None else _float(softcap, "final_logit_softcapping"),
            raw=raw,
            hf_config=hf,
            architecture=architecture,
            **dflash2,
        )

    @classmethod
    def from_pretrained(cls, draft_dir: str | Path, *, num_target_layers: int | None = None) -> "DFlashConfig":
        """Reads `<draft_dir>/config.json`."""
        path = Path(draft_dir) / "config.json"
        if not path.is_file():
            raise DraftCheckpointError(f"no config.json in drafter directory {draft_dir}")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DraftCheckpointError(f"{path} is not valid JSON: {err}") from err
        return cls.from_dict(raw, num_target_layers=num_target_layers)

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim/2] float32, attention scaling) — as transformers computes them."""
        if self.rope_type == "default":
            base = float(self.hf_config.rope_parameters["rope_theta"])
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float) / self.head_dim
            return 1.0 / (base**exponents), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise DraftCheckpointError(f"drafter rope_type={self.rope_type!r} is unknown")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.hf_config)
        return inv_freq.to(torch.float), float(scaling)


def _architecture(architectures: Any) -> str:
    # No `architectures` key: DFlash 1, as before DFlash 2 existed.
    if architectures is None:
        return DFLASH1
    if isinstance(architectures, (list, tuple)):
        for name in (DFLASH2, DFLASH1):
            if name in architectures:
                return name
    raise DraftCheckpointError(
        f"drafter config architectures={architectures!r}: only {DFLASH1!r} and {DFLASH2!r} are supported"
    )


def _dflash2_values(value: Any, hidden_size: int, vocab_size: int, block_size: int) -> dict[str, int]:
    """The DFlash 2 keys, each required and checked against the shapes it will give."""
    missing = [key for key in DFLASH2_KEYS if value(key) is None]
    if missing:
        raise DraftCheckpointError(
            f"{DFLASH2} config is missing {missing} (in dflash_config or at the top level)"
        )
    values = {key: _positive_int(value(key), key) for key in DFLASH2_KEYS}
    if hidden_size % values["conv_group_size"]:
        raise DraftCheckpointError(
            f"{DFLASH2} conv_group_size={values['conv_group_size']} does not divide hidden_size={hidden_size}"
        )
    # Taps past the block only ever read the zeros before it: such a config is a mistake.
    if values["conv_kernel_size"] > block_size:
        raise DraftCheckpointError(
            f"{DFLASH2} conv_kernel_size={values['conv_kernel_size']} exceeds block_size={block_size}"
        )
    if values["selector_top_k"] > vocab_size:
        raise DraftCheckpointError(
            f"{DFLASH2} selector_top_k={values['selector_top_k']} exceeds vocab_size={vocab_size}"
        )
    return values


def _layer_attention(hf: Any, raw: dict[str, Any], layer: int) -> tuple[bool, int | None]:
    # Same derivation as the reference: sliding layers are causal unless `is_causal` says otherwise;
    # full-attention layers see the whole [context ‖ block] with no mask.
    layer_types = getattr(hf, "layer_types", None)
    layer_type = layer_types[layer] if layer_types else "full_attention"
    is_causal = raw.get("is_causal")
    causal = layer_type == "sliding_attention" if is_causal is None else bool(is_causal)
    window = hf.sliding_window if layer_type == "sliding_attention" else None
    return causal, None if window is None else _positive_int(window, "sliding_window")


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise DraftCheckpointError(f"drafter config key {key!r} must be an integer, got {value!r}")
    return int(value)


def _positive_int(value: Any, key: str) -> int:
    number = _int(value, key)
    if number <= 0:
        raise DraftCheckpointError(f"drafter config key {key!r} must be positive, got {value!r}")
    return number


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DraftCheckpointError(f"drafter config key {key!r} must be a finite number, got {value!r}")
    return float(value)
