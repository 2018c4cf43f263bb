"""How many drafts each request verifies this step (`best_lengths`), under one of two objectives.

- `Throughput` (a server): expected tokens per second of the step. A slot that frees up is filled
  by the next request, so every token is worth the same.
- `Makespan` (the last requests of an offline batch, `Engine.generate` with a list once its queue
  is empty): nobody takes a freed slot, so only the time until the LAST request finishes counts.
  With plain steps costing a + b*n, the batch's remaining time run plain is a * max_i r_i +
  b * sum_i r_i (r_i: request i's remaining tokens), so a step saves
  a * E[how much closer the longest request's end came] + b * E[tokens it makes] of it: an extra
  token of the request furthest from its end is worth a + b, one of a request ahead only b. The
  step with the most seconds saved per second spent wins (a plain step saves what it costs: 1).
  With one request this is tokens per second again. Measured (docs/adaptive.md, 2026-11-28
  night): by tokens per second, an MT-Bench batch of 8 ran its drafted requests ahead and then 64
  steps at 1-7 requests that cost about what 8 do, and took 19.7 s where NONE took 17.9.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jax_backend.batch import bucket
from sgl_dflash.speculative.cost_model import MIN_TOKEN_ROWS, shape_of


def cap_to_budget(gains: np.ndarray, remaining: np.ndarray | None) -> np.ndarray:
    """gains [n, P] with the drafts a request cannot use zeroed: m drafts make up to m + 1
    tokens, so a request with r tokens left gains nothing from drafts past r - 1."""
    if remaining is None:
        return gains
    drafts = np.arange(1, gains.shape[1] + 1)[None, :]
    return np.where(drafts < np.asarray(remaining)[:, None], gains, 0.0)


class Throughput:
    """Expected tokens per second of the step (n plain tokens plus the drafts' gains)."""

    def weights(self, n: int) -> np.ndarray:
        return np.ones(n)

    def score(self, gains: np.ndarray, k: np.ndarray, draft_tokens: float, seconds: float) -> float:
        return (len(k) + draft_tokens) / seconds


class Makespan:
    """Seconds of the batch's remaining time (run plain) saved per second of the step."""

    def __init__(self, remaining: np.ndarray, plain_seconds: float, per_token: float):
        """remaining [n]: tokens each request may still make; plain_seconds: a plain step of these
        n requests; per_token: what one request adds to a step (b). The step's own part a is the
        plain step less n*b, so that a plain step saves exactly what it costs (score 1) and one
        request alone is chosen for as by tokens per second."""
        self.remaining = np.asarray(remaining, np.int64)
        self.slack = self.remaining.max() - self.remaining  # tokens a request is ahead of the longest
        self.per_token = per_token
        self.per_step = max(plain_seconds - per_token * len(self.remaining), 0.0)
        self._needs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def weights(self, n: int) -> np.ndarray:
        """What a token of each request is worth: the end comes closer only through the longest."""
        return self.per_token + self.per_step * (self.slack == 0)

    def advance(self, gains: np.ndarray, k: np.ndarray) -> float:
        """E[steps the batch's last token comes closer by]: with adv_i the tokens request i makes
        (P(adv_i > m) = gains[i, m-1] for m <= k_i) and independent requests, the remaining
        maximum max_i(r_i - adv_i) is below max_i r_i - j exactly when every request makes more
        than j - slack_i tokens, so the expected advance is 1 + sum_j prod_i P(adv_i > j - slack_i)."""
        num_positions = gains.shape[1]
        if num_positions not in self._needs:  # (the plan asks for a few widths, many times)
            need = np.arange(1, num_positions + 1)[None, :] - self.slack[:, None]  # drafts needed for j
            self._needs[num_positions] = (need <= 0, np.clip(need - 1, 0, num_positions - 1))
        free, column = self._needs[num_positions]
        passes = np.take_along_axis(gains, column, axis=1)
        passes = np.where(free, 1.0, np.where(column < k[:, None], passes, 0.0))
        return 1.0 + float(passes.prod(axis=0).sum())

    def score(self, gains: np.ndarray, k: np.ndarray, draft_tokens: float, seconds: float) -> float:
        """Seconds of the batch saved per second of the step."""
        return (self.per_step * self.advance(gains, k) + self.per_token * (len(k) + draft_tokens)) / seconds


def best_lengths(
    gains: np.ndarray, shape_cost: Callable[[tuple[int, int, int]], float], objective: Throughput | Makespan | None = None
) -> tuple[np.ndarray, float]:
    """The drafts k [n] to verify maximizing `objective`'s score (default: expected tokens /
    shape_cost(step_shape(k + 1))), and that score. gains [n, P]: g[i, m-1] = P(the first m drafts
    of request i are accepted), non-increasing along m. The cost depends on the step's shape only,
    so for every reachable shape (bucketed rows T, longest block Q) the candidate is the most
    valuable drafts that fit it (the objective's weight per request times the gain: values fall
    along a request's block, so the top ones are prefixes). Each candidate's shape is computed from
    its counts (`shape_of`) rather than from a lengths array: the plan runs this for every draft
    block on every step, on the host, before the device works."""
    objective = objective or Throughput()
    n, num_positions = gains.shape
    best_k = np.zeros(n, np.int64)
    best = objective.score(gains, best_k, 0.0, shape_cost(shape_of(n, n, 1)))
    if num_positions == 0 or n == 0:
        return best_k, best
    rows, cols = np.nonzero(gains > 0)
    weighted = gains[rows, cols] * objective.weights(n)[rows]
    order = np.lexsort((cols, -weighted))  # most valuable first; a block's prefix first
    rows, cols, values = rows[order], cols[order], gains[rows[order], cols[order]]
    cap = 2
    while True:  # cap = longest block (bonus + drafts) allowed: the attention's Q bucket
        keep = cols < cap - 1
        r, v = rows[keep], np.cumsum(values[keep])
        tokens = bucket(n, MIN_TOKEN_ROWS)
        while True:  # every token-row bucket the allocation can reach
            extra = min(tokens - n, len(r))
            if extra > 0:
                k = np.bincount(r[:extra], minlength=n)
                score = objective.score(gains, k, v[extra - 1], shape_cost(shape_of(n, n + extra, int(k.max()) + 1)))
                if score > best:
                    best_k, best = k, score
            if extra >= len(r):
                break
            tokens *= 2
        if cap - 1 >= num_positions:
            break
        cap *= 2
    return best_k, best
