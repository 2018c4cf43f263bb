"""The adaptive verify-length policy (issue 14): per request and per step, how many of its drafts
go to the target, chosen to maximize expected tokens per second of the whole step.

The DFlash drafter drafts a whole block in one forward, so drafting stays at the block size B;
what adapts is k_i in 0 .. B-1, the drafts request i verifies (0 = a plain decode step that
still yields one token). Three running models decide it (docs/adaptive.md):

- `Calibrator`: alpha = P(draft j accepted | drafts 1..j-1 were), from the drafter's confidence
  in draft j (its probability of the argmax), per position j and mode (greedy / sampled), in
  confidence bins with a Beta prior at the bin's confidence, updated with every verified draft;
  plus a per-request offset in logit space (`RequestState.bias`), updated online from that
  request's own outcomes (a request whose drafts fare better than their confidence says gets
  longer blocks).
- `CostModel` (in cost_model.py): seconds of a verify step per compiled shape, of a draft step
  per batch bucket, and of the rest of a step; running means of what the worker measured.
- `best_lengths`: with g[i, m] = P(the first m drafts of request i all pass) = prod_j<=m alpha,
  a step yields n + sum_i sum_{m<=k_i} g[i, m] tokens in expectation. The cost depends only on
  the step's shape (bucketed rows T, longest block Q), so for every reachable shape the best
  allocation is the largest gains that fit it (gains fall along a request's block, so the top
  ones are prefixes); the shape with the most tokens per second wins.

Before drafting, `plan_drafts` runs the same choice on each request's recent acceptance (no
confidences yet) and the draft cost: a step whose drafts would not pay runs no drafter at all.
A request left undrafted for `probe_every` steps is drafted anyway, so its estimate can recover.

Sampling stays lossless because k_i depends on the drafter's distributions q (max q), never on
the sampled drafts: rejection sampling over the first k_i drafts is the standard algorithm for a
block of k_i + 1 tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from sgl_dflash.speculative.cost_model import CostModel, step_shape

GREEDY, SAMPLED = 0, 1


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class Calibrator:
    """Acceptance probability of a draft from its confidence, per mode and draft position."""

    def __init__(self, num_positions: int, num_bins: int = 10, prior_weight: float = 4.0):
        self.num_bins = num_bins
        self.centers = (np.arange(num_bins) + 0.5) / num_bins
        shape = (2, num_positions, num_bins)
        # Beta prior: `prior_weight` pseudo-drafts at the bin's confidence (a calibrated drafter).
        self.hits = np.broadcast_to(self.centers * prior_weight, shape).copy()
        self.trials = np.full(shape, prior_weight)

    def bins(self, confidence: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(confidence) * self.num_bins).astype(np.int64), 0, self.num_bins - 1)

    def alpha(self, modes: np.ndarray, confidence: np.ndarray) -> np.ndarray:
        """[n, P] calibrated acceptance probabilities (before any per-request offset)."""
        table = self.hits / self.trials
        positions = np.arange(confidence.shape[1])[None, :]
        return table[np.asarray(modes)[:, None], positions, self.bins(confidence)]

    def position_means(self, mode: int) -> np.ndarray:
        """[P] acceptance per position over all confidences seen (the no-confidence estimate)."""
        return self.hits[mode].sum(axis=1) / self.trials[mode].sum(axis=1)

    def observe(self, mode: int, confidence: np.ndarray, outcomes: np.ndarray) -> None:
        """outcomes[j] for the observed positions 0 .. len(outcomes)-1 (1 = accepted)."""
        m = len(outcomes)
        cells = (mode, np.arange(m), self.bins(confidence[:m]))
        np.add.at(self.hits, cells, outcomes)
        np.add.at(self.trials, cells, 1.0)


@dataclasses.dataclass
class RequestState:
    """A running request's part of the policy (the worker keeps one per slot)."""

    estimate: np.ndarray  # [P] its recent calibrated acceptance per position (before drafting)
    bias: float = 0.0  # logit offset learned from its own outcomes
    idle: int = 0  # steps since it was last drafted


def best_lengths(
    gains: np.ndarray, step_cost: Callable[[np.ndarray], float]
) -> tuple[np.ndarray, float]:
    """The drafts k [n] to verify maximizing expected tokens / step_cost(q_lens = k + 1), and
    that rate. gains [n, P]: g[i, m-1] = P(the first m drafts of request i are accepted), non-
    increasing along m. step_cost depends on the step's shape only (`step_shape`)."""
    n, num_positions = gains.shape
    best_k, best_rate = np.zeros(n, np.int64), n / step_cost(np.ones(n, np.int64))
    if num_positions == 0 or n == 0:
        return best_k, best_rate
    rows, cols = np.nonzero(gains > 0)
    order = np.lexsort((cols, -gains[rows, cols]))  # largest gain first; a block's prefix first
    rows, cols, values = rows[order], cols[order], gains[rows[order], cols[order]]
    cap = 2
    while True:  # cap = longest block (bonus + drafts) allowed: the attention's Q bucket
        keep = cols < cap - 1
        r, v = rows[keep], np.cumsum(values[keep])
        tokens = 2
        while tokens < n:
            tokens *= 2
        while True:  # every token-row bucket the allocation can reach
            extra = min(tokens - n, len(r))
            if extra > 0:
                k = np.bincount(r[:extra], minlength=n)
                rate = (n + v[extra - 1]) / step_cost(k + 1)
                if rate > best_rate:
                    best_k, best_rate = k, rate
            if extra >= len(r):
                break
            tokens *= 2
        if cap - 1 >= num_positions:
            break
        cap *= 2
    return best_k, best_rate


class AdaptivePolicy:
    """Chooses per-request verify lengths for a `DFlashWorker`'s decode steps."""

    def __init__(self, num_drafts: int, probe_every: int = 16, learning_rate: float = 0.25,
                 estimate_decay: float = 0.5, cost_model: CostModel | None = None):
        self.num_drafts = num_drafts  # P = B - 1: drafts per request per draft step
        self.probe_every = probe_every
        self.learning_rate = learning_rate
        self.estimate_decay = estimate_decay
        self.calibrator = Calibrator(num_drafts)
        self.cost = cost_model or CostModel()
        self.requests: dict[int, RequestState] = {}

    # -- request lifecycle ----------------------------------------------------------------
    def add(self, slot: int, mode: int = GREEDY) -> None:
        self.requests[slot] = RequestState(self.calibrator.position_means(mode))

    def release(self, slot: int) -> None:
        self.requests.pop(slot, None)

    def _state(self, slot: int) -> RequestState:
        if slot not in self.requests:  # e.g. a worker driven without forward_extend (tests)
            self.add(slot)
        return self.requests[slot]

    # -- decisions --------------------------------------------------------------------------
    def plan_drafts(self, slots: Sequence[int]) -> np.ndarray:
        """bool [n]: the requests to draft this step. None when the drafts would not pay for the
        drafter (by each request's recent acceptance), except probes of long-idle requests; the
        drafter's batch bucket is filled with the next most promising requests (free)."""
        n = len(slots)
        states = [self._state(s) for s in slots]
        gains = np.cumprod(np.stack([s.estimate for s in states]), axis=1)
        draft_cost = self.cost.draft(n)
        k, rate = best_lengths(gains, lambda q: draft_cost + self.step_cost(q))
        ar_rate = n / self.step_cost(np.ones(n, np.int64))
        chosen = (k > 0) if rate > ar_rate else np.zeros(n, bool)
        chosen |= np.array([s.idle + 1 >= self.probe_every for s in states])
        count = int(chosen.sum())
        if 0 < count < n:
            room = (1 << (count - 1).bit_length()) - count  # the drafter pads to a power of two
            rest = [i for i in np.argsort(-gains[:, 0], kind="stable") if not chosen[i]]
            chosen[rest[:room]] = True
        return chosen

    def choose(self, slots: Sequence[int], modes: np.ndarray, drafted: np.ndarray,
               confidence: np.ndarray | None, draft_seconds: float) -> np.ndarray:
        """k [n]: drafts to verify per request (0 for undrafted ones). confidence [n, P] (rows of
        undrafted requests ignored; None: no confidences, the recent estimates stand in)."""
        alpha = self.alphas(slots, modes, confidence)
        gains = np.where(drafted[:, None], np.cumprod(alpha, axis=1), 0.0)
        k, _ = best_lengths(gains, lambda q: draft_seconds + self.step_cost(q))
        return k

    def alphas(self, slots: Sequence[int], modes: np.ndarray, confidence: np.ndarray | None) -> np.ndarray:
        states = [self._state(s) for s in slots]
        if confidence is None:
            return np.stack([s.estimate for s in states])
        base = np.clip(self.calibrator.alpha(modes, confidence), 1e-3, 1 - 1e-3)
        bias = np.array([s.bias for s in states])[:, None]
        return _sigmoid(_logit(base) + bias)

    def step_cost(self, q_lens: np.ndarray) -> float:
        return self.cost.overhead + self.cost.verify(step_shape(q_lens))

    # -- learning -------------------------------------------------------------------------
    def observe(self, slots: Sequence[int], modes: np.ndarray, drafted: np.ndarray, confidence: np.ndarray | None,
                verified: np.ndarray, accepted: np.ndarray) -> None:
        """After the verify step: outcomes update the calibration, the request offsets and
        the recent estimates. Position j of request i is observed when j <= min(a_i + 1, k_i)."""
        alpha = self.alphas(slots, modes, confidence)
        for i, slot in enumerate(slots):
            state = self._state(slot)
            if not drafted[i]:
                state.idle += 1
                continue
            state.idle = 0
            seen = min(int(accepted[i]) + 1, int(verified[i]))
            outcomes = (np.arange(seen) < accepted[i]).astype(np.float64)
            if confidence is not None:
                state.estimate = (1 - self.estimate_decay) * state.estimate + self.estimate_decay * alpha[i]
                self.calibrator.observe(int(modes[i]), confidence[i], outcomes)
            else:  # no confidences: the estimate follows the outcomes themselves
                state.estimate[:seen] = (1 - self.estimate_decay) * state.estimate[:seen] + self.estimate_decay * outcomes
            if seen:
                step = self.learning_rate * (outcomes - alpha[i, :seen]).sum()
                state.bias = float(np.clip(state.bias + step, -3, 3))
