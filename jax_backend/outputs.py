"""What TargetRunner's steps return: per-sequence logits, tokens, accept counts and the
drafter's features (`jax_backend.runner`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class AuxRows:
    """Per-sequence rows of a step's aux layers: `features[i]` np.float32 [q_len, n_aux * H], the
    drafter's context features (`hidden_state_features`), and `raw[i]` the aux layers' outputs as
    they are (concatenated in `aux_layer_ids` order). Sliced on the host, since a device slice
    compiles once per q_len (once per new prompt length, in the middle of serving); `raw` is copied
    only when read (tests compare it with transformers; serving needs only the features)."""

    features: list[np.ndarray] | tuple = ()
    padded: jax.Array | None = None  # the step's aux [T, n_aux * H], on the device
    spans: tuple[slice, ...] = ()

    @property
    def raw(self) -> list[np.ndarray] | tuple:
        host = None if self.padded is None else np.asarray(self.padded)
        return () if host is None else [host[span] for span in self.spans]


class _AuxViews:
    """`aux_hidden` and `features` of an output's `aux` rows: `AuxRows.raw` / `AuxRows.features`
    (empty when the runner has no aux layers)."""

    aux: AuxRows

    @property
    def aux_hidden(self) -> list[np.ndarray] | tuple:
        return self.aux.raw

    @property
    def features(self) -> list[np.ndarray] | tuple:
        return self.aux.features


@dataclasses.dataclass(frozen=True)
class ForwardOutput(_AuxViews):
    """`logits[i]`: np.float32 [1, V] ("last") or [q_len, V] ("all") for sequence i; `aux_hidden`
    and `features` as `AuxRows.raw` / `AuxRows.features` (empty when the runner has no aux layers)."""

    logits: list[np.ndarray]
    aux: AuxRows = AuxRows()


@dataclasses.dataclass(frozen=True)
class SampleOutput(_AuxViews):
    """`tokens`: np.int32 [n], one sampled token per sequence (from its last position; `wait=False`:
    every padded row's, left on the device); `aux_hidden` and `features` as in `ForwardOutput`."""

    tokens: np.ndarray | jax.Array
    aux: AuxRows = AuxRows()
    # `sample(..., device_features=True)`: the drafter's features [T, n_aux*H] on the device (rows past n pad); no `aux`
    device_features: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    """Per block: `accepted` drafts (np.int32 [n]), the target's `bonus` token after them
    (np.int32 [n]), and `features` [S, B, n_aux*H] (device; rows >= n are padding): the drafter's
    context features (`hidden_state_features`) of every block row (rows past a ragged block's
    end repeat its last row); sequence i commits rows 0 .. accepted[i]."""

    accepted: np.ndarray
    bonus: np.ndarray
    features: jax.Array
