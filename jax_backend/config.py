"""Target model configuration parsed from a Hugging Face config.json (Llama and Qwen3 only)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A target checkpoint is missing, malformed or unsupported; the message names the culprit."""


# HF architecture name -> our short name. Qwen3 adds per-head RMSNorm on q and k.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is "linear" (all frequencies / factor) or "llama3"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Everything the JAX target needs from config.json. Hashable: usable as a jit static."""

    architecture: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def as_dict(self) -> dict:
        """The subset other packages need (see docs/interfaces.md `target_config_dict`)."""
        return {
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "TargetConfig":
        return _parse(raw, source)

    @classmethod
    def from_file(cls, path: str | Path) -> "TargetConfig":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"config file not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return _parse(raw, str(path))


def _parse(raw: dict[str, Any], source: str) -> TargetConfig:
    arch = _architecture(raw, source)

    def get(key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
        value = raw.get(key, default)
        if value is dataclasses.MISSING or value is None and default is dataclasses.MISSING:
            raise CheckpointError(f"{source}: missing required key {key!r}")
        if value is None:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(
                f"{source}: key {key!r} must be {kind.__name__}, got {value!r}"
            )
        return value

    num_heads = get("num_attention_heads", int)
    hidden_size = get("hidden_size", int)
    num_kv_heads = get("num_key_value_heads", int, num_heads)
    head_dim = get("head_dim", int, None)
    if head_dim is None:
        if hidden_size % num_heads:
            raise CheckpointError(
                f"{source}: hidden_size {hidden_size} is not divisible by "
                f"num_attention_heads {num_heads} and no head_dim is given"
            )
        head_dim = hidden_size // num_heads
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads {num_heads} must be a multiple of "
            f"num_key_value_heads {num_kv_heads}"
        )
    if head_dim % 2:
        raise CheckpointError(f"{source}: head_dim must be even for RoPE, got {head_dim}")

    _refuse_unsupported(raw, source)
    rope_theta, rope_scaling = _rope(raw, source)

    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_ids):
        raise CheckpointError(f"{source}: eos_token_id must be an int or a list of ints, got {eos!r}")

    return TargetConfig(
        architecture=arch,
        vocab_size=get("vocab_size", int),
        hidden_size=hidden_size,
        intermediate_size=get("intermediate_size", int),
        num_hidden_layers=get("num_hidden_layers", int),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get("rms_norm_eps", float, 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=get("tie_word_embeddings", bool, False),
        max_position_embeddings=get("max_position_embeddings", int, 2048),
        bos_token_id=get("bos_token_id", int, None),
        eos_token_ids=eos_ids,
    )


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if archs is None:
        model_type = raw.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise CheckpointError(
                f"{source}: unsupported model_type {model_type!r} (no 'architectures'); "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        archs = [_MODEL_TYPES[model_type]]
    if not isinstance(archs, list) or len(archs) != 1:
        raise CheckpointError(f"{source}: 'architectures' must list exactly one class, got {archs!r}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{source}: unsupported architecture {archs[0]!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return SUPPORTED_ARCHITECTURES[archs[0]]


def _refuse_unsupported(raw: dict[str, Any], source: str) -> None:
    """Refuse options that change the math in ways this implementation does not follow."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: unsupported hidden_act {act!r} (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag, False):
            raise CheckpointError(f"{source}: unsupported {flag}=true (bias-free projections only)")
    if raw.get("use_sliding_window", False):
        raise CheckpointError(f"{source}: unsupported use_sliding_window=true")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise CheckpointError(f"{source}: unsupported layer_types {sorted(set(layer_types))}")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise CheckpointError(f"{source}: unsupported pretraining_tp={raw['pretraining_tp']}")


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Read RoPE settings from either the transformers-5 `rope_parameters` dict or the legacy
    top-level `rope_theta` + `rope_scaling` keys."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: unsupported RoPE scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: unsupported partial_rotary_factor {params['partial_rotary_factor']}")
    theta = params.get("rope_theta")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise CheckpointError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    if rope_type == "default":
        return float(theta), None
    try:
        if rope_type == "linear":
            scaling = RopeScaling("linear", float(params["factor"]))
        else:
            scaling = RopeScaling(
                "llama3",
                float(params["factor"]),
                float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                int(params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))),
            )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: incomplete {rope_type!r} RoPE scaling {params!r}: {e!r}") from e
    return float(theta), scaling
