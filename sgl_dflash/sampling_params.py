"""Per-request sampling parameters, with SGLang's names and defaults."""

from __future__ import annotations

import dataclasses
from typing import Any

from sgl_dflash.errors import SamplingParamsError


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = whole vocabulary
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        """Build from a JSON-style dict; unknown keys are an error, not silently dropped."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, dict):
            raise SamplingParamsError("*", f"expected a dict, got {type(params).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise SamplingParamsError(
                unknown[0], f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**params)

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise `SamplingParamsError` naming the first invalid field."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise SamplingParamsError("max_new_tokens", f"must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise SamplingParamsError("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise SamplingParamsError("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError("top_k", f"must be -1 (disabled) or an int >= 0, got {self.top_k!r}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise SamplingParamsError("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple, set)) or not all(_is_token_id(t, vocab_size) for t in ids):
                raise SamplingParamsError(
                    "stop_token_ids", f"must be a list of token ids in [0, {vocab_size}), got {ids!r}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")

    @property
    def stop_strs(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _is_token_id(value: Any, vocab_size: int | None) -> bool:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return False
    return vocab_size is None or value < vocab_size
