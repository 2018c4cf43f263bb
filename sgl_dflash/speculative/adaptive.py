"""The adaptive verify-length policy (issue 14): per request and per step, how many of its drafts
go to the target, chosen to maximize expected tokens per second of the whole step.

The DFlash drafter drafts a whole block in one forward, so drafting stays at the block size B;
what adapts is k_i in 0 .. B-1, the drafts request i verifies (0 = a plain decode step that
still yields one token). Three running models decide it (docs/adaptive.md):

- `Calibrator` (in calibration.py): alpha = P(draft j accepted | drafts 1..j-1 were), from the
  drafter's confidence in draft j (its probability of the argmax), per position j and mode
  (greedy / sampled), in confidence bins with a Beta prior at the bin's confidence, updated with
  every verified draft; plus a per-request offset in logit space (`RequestState.bias`), updated
  online from that request's own outcomes (a request whose drafts fare better than their
  confidence says gets longer blocks).
- `CostModel` (in cost_model.py): seconds of a verify step per compiled shape, of a draft step
  per batch bucket, and of the rest of a step; running means of what the worker measured.
- `best_lengths`: with g[i, m] = P(the first m drafts of request i all pass) = prod_j<=m alpha,
  a step yields n + sum_i sum_{m<=k_i} g[i, m] tokens in expectation. The cost depends only on
  the step's shape (bucketed rows T, longest block Q), so for every reachable shape the best
  allocation is the largest gains that fit it (gains fall along a request's block, so the top
  ones are prefixes); the shape with the most tokens per second wins.

Before drafting, `plan_drafts` runs the same choice on each request's recent acceptance (no
confidences yet) for each draft block the drafter can run (2, 4, .., B tokens: the drafter fills a
block in one forward, and a shorter block is a cheaper forward), with that block's measured draft
cost: the block with the most tokens per second wins, and a step whose drafts would not pay runs
no drafter at all. A request left undrafted for `probe_every` steps is drafted anyway (at the
block that came closest to paying), so its estimate can recover; a step that would draft runs
plain when the plain step's cost was last measured `refresh_every` steps ago. Every
`explore_every`-th step, shapes and draft blocks not measured recently look cheaper than
predicted (`explore_discount`), so a choice that may be better gets measured; a program never
compiled also carries a share of its compile time. At a load where drafts may not pay even for a
typical request (`drafts_may_pay`), a joining request gets no drafter context (NONE's steps);
where steps with context ran at a load, what they realized decides (`realized.RealizedGains`).

Sampling stays lossless because k_i depends on the drafter's distributions q (max q), never on
the sampled drafts: rejection sampling over the first k_i drafts is the standard algorithm for a
block of k_i + 1 tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from jax_backend.batch import bucket
from sgl_dflash.speculative.calibration import Calibrator
from sgl_dflash.speculative.cost_model import MIN_TOKEN_ROWS, CostModel, shape_of, step_shape
from sgl_dflash.speculative.realized import RealizedGains

GREEDY, SAMPLED = 0, 1


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclasses.dataclass
class RequestState:
    """A running request's part of the policy (the worker keeps one per slot)."""

    estimate: np.ndarray  # [P] its recent calibrated acceptance per position (before drafting)
    mean: np.ndarray  # [P] the same, averaged over its whole life (slowly)
    bias: float = 0.0  # logit offset learned from its own outcomes
    idle: int = 0  # steps since it was last drafted


@dataclasses.dataclass(frozen=True)
class Allocation:  # a candidate of `best_lengths`
    counts: np.ndarray  # [n] drafts verified per request
    gain: float  # expected accepted drafts: the sum of the gains allocated
    shape: tuple[int, int, int]
    cap: int  # the longest block (bonus + drafts) it was allowed: the attention's Q bucket


def allocations(gains: np.ndarray) -> list[Allocation]:
    """Every allocation `best_lengths` weighs, in its order: per cap on the longest block (2, 4, ..
    until the cap holds every position) and per token-row bucket it can reach, the largest gains
    that fit (gains fall along a request's block, so the largest ones are prefixes). gains [n, P]:
    g[i, m-1] = P(the first m drafts of request i pass), non-increasing along m."""
    n, num_positions = gains.shape
    if num_positions == 0 or n == 0:
        return []
    rows, cols = np.nonzero(gains > 0)
    order = np.lexsort((cols, -gains[rows, cols]))  # largest gain first; a block's prefix first
    rows, cols, values = rows[order], cols[order], gains[rows[order], cols[order]]
    found, cap = [], 2
    while True:
        keep = cols < cap - 1
        r, v = rows[keep], np.cumsum(values[keep])
        tokens = bucket(n, MIN_TOKEN_ROWS)
        while True:  # every token-row bucket the allocation can reach
            extra = min(tokens - n, len(r))
            if extra > 0:
                k = np.bincount(r[:extra], minlength=n)
                found.append(Allocation(k, float(v[extra - 1]), shape_of(n, n + extra, int(k.max()) + 1), cap))
            if extra >= len(r):
                break
            tokens *= 2
        if cap - 1 >= num_positions:
            return found
        cap *= 2


def best_lengths(
    gains: np.ndarray, shape_cost: Callable[[tuple[int, int, int]], float],
    candidates: Sequence[Allocation] | None = None,
) -> tuple[np.ndarray, float]:
    """The drafts k [n] to verify maximizing expected tokens / shape_cost(step_shape(k + 1)),
    and that rate. The cost depends on the step's shape only, so the best allocation of each
    reachable shape is its largest gains (`allocations`; `candidates`: those of these gains,
    computed once for several costs). The plan runs this for every draft block on every step, on
    the host, before the device works."""
    n = gains.shape[0]
    best_k, best_rate = np.zeros(n, np.int64), n / shape_cost(shape_of(n, n, 1))
    for allocation in allocations(gains) if candidates is None else candidates:
        rate = (n + allocation.gain) / shape_cost(allocation.shape)
        if rate > best_rate:
            best_k, best_rate = allocation.counts, rate
    return best_k, best_rate


@dataclasses.dataclass(frozen=True)
class DraftPlan:
    """Which requests the drafter drafts this step, and the draft block: `block` tokens (the
    bonus and block - 1 drafts) per drafted request; 0 when nothing is drafted."""

    drafted: np.ndarray  # bool [n]
    block: int


def draft_blocks(block_size: int) -> tuple[int, ...]:
    """The draft blocks a drafter of `block_size` may run: powers of two from 2, and its own."""
    return tuple(sorted({1 << e for e in range(1, block_size.bit_length()) if 1 << e < block_size} | {block_size}))


class AdaptivePolicy:
    """Chooses per-request verify lengths (and the draft block) for a `DFlashWorker`'s decode steps."""

    def __init__(self, num_drafts: int, probe_every: int = 16, learning_rate: float = 0.25,
                 estimate_decay: float = 0.5, mean_decay: float = 0.1, idle_relax: float = 0.25,
                 cost_model: CostModel | None = None,
                 explore_every: int = 8, explore_discount: float = 0.7, compile_horizon: int = 64,
                 refresh_every: int = 32, min_gain: float = 0.05, probe_slack: float = 0.25,
                 admit_ratio: float = 1.05, admit_evidence: int = 32, realized: RealizedGains | None = None,
                 context_cost: float = 0.03, prior_acceptance: np.ndarray | None = None):
        self.num_drafts = num_drafts  # P = B - 1: drafts per request of the drafter's full block
        self.blocks = draft_blocks(num_drafts + 1)
        self.probe_every, self.learning_rate, self.estimate_decay = probe_every, learning_rate, estimate_decay
        # Each idle step an undrafted request's estimate moves `idle_relax` of the way back to its
        # long-run mean (`mean_decay`: that mean's EMA weight); else one step of low confidence
        # kept it low until the next probe (gsm8k at one request: half its steps plain).
        self.mean_decay, self.idle_relax = mean_decay, idle_relax
        # Every `explore_every`-th step, what was never measured looks `explore_discount` times as
        # costly as predicted: a shape or draft block that may be better gets tried and measured.
        self.explore_every, self.explore_discount = explore_every, explore_discount
        # A shape never run at this context costs a compile, spread over the steps to come (at
        # least this many; N steps run at this page-table width are taken to mean N more).
        self.compile_horizon = compile_horizon
        # A step that would draft runs plain when the plain step's cost is this many steps old
        # (only plain steps measure it, and an inflated reading would keep the policy drafting).
        self.refresh_every = refresh_every
        # A drafted step must be expected to beat the plain step by `min_gain`: its prediction
        # errs by a few percent, and at batch 8 and 32 an edge of 1-2% was a coin toss that lost.
        self.min_gain = min_gain
        # A probe is drafted only if expected to lose at most `probe_slack` of the plain rate.
        self.probe_slack = probe_slack
        # `drafts_may_pay`: context where a typical request's drafts clear a drafted step's bar
        # (1 + `min_gain`; at 1.0 batches of 8 got it, drafted 0-7% of steps, lost 2-6%); before
        # `admit_evidence` drafts were read, by the drafter's recorded acceptance [P] (or None).
        self.admit_ratio, self.admit_evidence, self.prior_acceptance = admit_ratio, admit_evidence, prior_acceptance
        self.startup_admits: int | None = None  # `drafts_may_pay` (the worker sets it)
        # What drafter context costs a step, as a fraction of its tokens: adaptive with no
        # drafting ran at 0.95-0.98x NONE (docs/adaptive.md, 2026-11-27 night).
        self.context_cost = context_cost
        self.calibrator = Calibrator(num_drafts)
        self.cost = cost_model or CostModel()
        self.realized = realized or RealizedGains()  # what steps with context gained, per load
        # False near the process's limit of compiled programs (jax_backend.compiled_memory; the
        # worker sets it): no drafted program is compiled then. Plain steps still compile.
        self.may_compile = True
        self.requests: dict[int, RequestState] = {}
        self.steps = 0
        self._judging = False  # `typical_gain` is pricing: no exploration discount

    # -- request lifecycle ----------------------------------------------------------------
    def add(self, slot: int, mode: int = GREEDY) -> None:
        estimate = self.calibrator.position_means(mode)
        self.requests[slot] = RequestState(estimate, estimate.copy())

    def release(self, slot: int) -> None:
        self.requests.pop(slot, None)

    def _state(self, slot: int) -> RequestState:
        if slot not in self.requests:  # e.g. a worker driven without forward_extend (tests)
            self.add(slot)
        return self.requests[slot]

    # -- decisions --------------------------------------------------------------------------
    @property
    def exploring(self) -> bool:
        return self.explore_every > 0 and self.steps % self.explore_every == 0 and not self._judging

    def plan_drafts(self, slots: Sequence[int], draftable: np.ndarray | None = None) -> DraftPlan:
        """The requests to draft this step and the draft block, by each request's recent
        acceptance: for each draft block, the best allocation of its drafts with the drafter's
        cost added; none when no block beats the plain step by `min_gain`, except probes of
        long-idle requests (at the block closest to paying, unless even that loses more than
        `probe_slack`). The drafter's batch bucket is filled with the next most promising
        requests (free). `draftable` [n]: the requests with drafter context (default all)."""
        self.steps += 1
        n = len(slots)
        draftable = np.ones(n, bool) if draftable is None else np.asarray(draftable, bool)
        states = [self._state(s) for s in slots]
        gains = np.cumprod(np.stack([s.estimate for s in states]), axis=1) * draftable[:, None]
        plain_rate = n / self.shape_cost(step_shape(np.ones(n, np.int64)))
        best_rate, best_k, block = plain_rate * (1 + self.min_gain), np.zeros(n, np.int64), 0
        probe_block, probe_rate = self.blocks[0], 0.0  # the drafting block valued most, paying or not
        verify_costs: dict[tuple[int, int, int], float] = {}  # the blocks' allocations share shapes

        def verify_cost(shape: tuple[int, int, int]) -> float:
            if shape not in verify_costs:
                verify_costs[shape] = self.shape_cost(shape)
            return verify_costs[shape]

        candidates = allocations(gains)  # those of a block b are the ones capped below 2b
        for b in self.blocks:
            draft_cost = self.draft_cost(n, b)
            k, rate = best_lengths(gains[:, : b - 1], lambda shape: draft_cost + verify_cost(shape),
                                   [a for a in candidates if a.cap < 2 * b])
            if k.any() and rate > best_rate:
                best_rate, best_k, block = rate, k, b
            if k.any() and rate > probe_rate:
                probe_block, probe_rate = b, rate
        if block and self._plain_cost_is_stale(n):
            return DraftPlan(np.zeros(n, bool), 0)
        chosen = best_k > 0
        probes = np.array([s.idle + 1 >= self.probe_every for s in states]) & draftable
        if probes.any() and not block:
            if probe_rate < (1 - self.probe_slack) * plain_rate:
                probes[:] = False  # hopeless here: the idle estimates keep relaxing to their means
            elif (bucket(int(probes.sum())), probe_block) not in self.cost.compiled_draft:
                probes[:] = False  # a probe is not worth a compile (a second or two on a CPU)
            else:  # the block the plan would draft with a little better estimates (measured so)
                block = probe_block
        chosen |= probes
        count = int(chosen.sum())
        if 0 < count < n:
            room = (1 << (count - 1).bit_length()) - count  # the drafter pads to a power of two
            rest = [i for i in np.argsort(-gains[:, 0], kind="stable") if draftable[i] and not chosen[i]]
            chosen[rest[:room]] = True
        return DraftPlan(chosen, block if chosen.any() else 0)

    def drafts_may_pay(self, n: int) -> bool:
        """Whether a batch of n requests of the typical acceptance (`Calibrator.typical_means`) has
        a drafted allocation at `admit_ratio` x the plain rate or better. Until `admit_evidence`
        first drafts were read the drafter's recorded acceptance (`prior_acceptance`, on unseen
        prompts) stands in, and without one the answer is yes. Where not, a joining request gets no
        drafter context (ingest, commits, probes: ~3% of NONE's step for nothing), but every 64th.
        Past `startup_admits` requests, no until the load's plain step was served: startup read
        verify shapes there on the scan, the plain step before the layer tuner chose (a fresh 32
        read 1.14x for what ran at 0.47x NONE, docs/adaptive.md). Where 256 request-steps with
        context ran at this load, what they realized decides instead (`context_lost`)."""
        if self.startup_admits is not None and n > self.startup_admits and not self.cost.readings(
                step_shape(np.ones(n, np.int64))):
            return False
        if self.realized.context_gain(n) is not None:
            return not self.context_lost(n)
        if self.calibrator.drafts_seen(GREEDY) >= self.admit_evidence:
            return self.typical_gain(n) >= self.admit_ratio
        return self.prior_acceptance is None or self.typical_gain(n, self.prior_acceptance) >= self.admit_ratio

    def typical_gain(self, n: int, means: np.ndarray | None = None) -> float:
        """The best drafted allocation's predicted tokens per second for n requests of the typical
        acceptance (`means` [P], default `Calibrator.typical_means`, greedy), over the plain step's."""
        means = self.calibrator.typical_means(GREEDY) if means is None else means
        gains = np.tile(np.cumprod(means), (n, 1))
        candidates, best = allocations(gains), 0.0
        # Costs as predicted, not as exploring steps see them (a batch of 8 let in at 1.32 ran 0.93)
        self._judging = True
        try:
            for b in self.blocks:
                draft_cost = self.draft_cost(n, b)
                for a in (a for a in candidates if a.cap < 2 * b):
                    best = max(best, (n + a.gain) / (draft_cost + self.shape_cost(a.shape)))
            return best / (n / self.shape_cost(step_shape(np.ones(n, np.int64))))
        finally:
            self._judging = False

    def context_lost(self, n: int) -> bool:
        """Whether steps with drafter context at n requests realized less than context costs
        (`RealizedGains.context_gain`, once read often enough there): the worker then serves the
        running requests without it (NONE's steps)."""
        realized = self.realized.context_gain(n)
        return realized is not None and realized < self.context_cost

    def _plain_cost_is_stale(self, n: int) -> bool:
        """The plain step of n requests is compiled and its cost not measured in `refresh_every`
        steps, or not yet read often enough to be the clock (a plain step that would compile is
        never forced: a compile stalls for seconds)."""
        shape = step_shape(np.ones(n, np.int64))
        age = self.cost.age(shape)
        return (self.refresh_every > 0 and shape in self.cost.compiled_verify
                and (age is None or age >= self.refresh_every or self.cost.readings(shape) < self.cost.min_clock_readings))

    def choose(self, slots: Sequence[int], modes: np.ndarray, drafted: np.ndarray,
               confidence: np.ndarray | None, draft_seconds: float, block: int | None = None) -> np.ndarray:
        """k [n]: drafts to verify per request (0 for undrafted ones; at most block - 1, the
        drafts drafted). confidence [n, P] (rows of undrafted requests and positions past the
        block ignored; None: no confidences, the recent estimates stand in)."""
        limit = self.num_drafts if block is None else block - 1
        alpha = self.alphas(slots, modes, confidence)[:, :limit]
        gains = np.where(drafted[:, None], np.cumprod(alpha, axis=1), 0.0)
        k, _ = best_lengths(gains, lambda shape: draft_seconds + self.shape_cost(shape))
        return k

    def alphas(self, slots: Sequence[int], modes: np.ndarray, confidence: np.ndarray | None) -> np.ndarray:
        states = [self._state(s) for s in slots]
        if confidence is None:
            return np.stack([s.estimate for s in states])
        base = np.clip(self.calibrator.alpha(modes, confidence), 1e-3, 1 - 1e-3)
        bias = np.array([s.bias for s in states])[:, None]
        return _sigmoid(_logit(base) + bias)

    def plain_seconds(self, n: int) -> float:
        """Predicted seconds of a plain step of n requests (measured: no exploration, no compile)."""
        return self.cost.overhead + self.cost.verify(step_shape(np.ones(n, np.int64)))

    def shape_cost(self, shape: tuple[int, int, int]) -> float:
        """Seconds of a verify step of this (S, T, Q) shape, as the choice sees it (`_explored`)."""
        compiled = shape in self.cost.compiled_verify
        if not (compiled or self.may_compile or shape[2] == 1):  # Q = 1: the plain step
            return math.inf
        seconds = self._explored(self.cost.verify(shape), self.cost.fresh("verify", shape), compiled)
        return self.cost.overhead + seconds

    def draft_cost(self, batch: int, block: int) -> float:
        key = (bucket(batch), block)
        compiled = key in self.cost.compiled_draft
        if not (compiled or self.may_compile):
            return math.inf
        return self._explored(self.cost.draft(batch, block), self.cost.fresh("draft", key), compiled)

    def _explored(self, seconds: float, measured: bool, compiled: bool) -> float:
        """A prediction as the choice sees it: on exploration steps, a program not measured
        recently (`CostModel.fresh`) looks cheaper than predicted (else a shape the prediction
        rules out is never measured: at 32 requests a 2-token verify was predicted at 1.67x a plain
        step, measured 1.26x); one never compiled also carries its share of a compile."""
        if self.exploring and not measured:
            seconds *= self.explore_discount
        return seconds if compiled else seconds + self._compile_share()

    def _compile_share(self) -> float:
        # Steps to come at this context are guessed as those run there so far: a server long at
        # a width amortizes a compile there, a batch that just crossed into a new one does not.
        return self.cost.compile_s / max(self.compile_horizon, self.cost.steps_here())

    # -- learning -------------------------------------------------------------------------
    def observe(self, slots: Sequence[int], modes: np.ndarray, drafted: np.ndarray, confidence: np.ndarray | None,
                verified: np.ndarray, accepted: np.ndarray, block: int | None = None) -> None:
        """After the verify step: outcomes update the calibration, the request offsets and
        the recent estimates (of the drafted block's positions). Position j of request i is
        observed when j <= min(a_i + 1, k_i)."""
        states = [self._state(s) for s in slots]
        drafted = np.asarray(drafted, bool)
        if not drafted.any():  # a plain step observes nothing: each estimate only relaxes (below)
            for state in states:
                state.estimate = state.estimate + self.idle_relax * (state.mean - state.estimate)
                state.idle += 1
            return
        limit = self.num_drafts if block is None else block - 1
        alpha = self.alphas(slots, modes, confidence)
        estimate, mean = np.stack([s.estimate for s in states]), np.stack([s.mean for s in states])
        accepted, positions = np.asarray(accepted), np.arange(estimate.shape[1])[None, :]
        seen = np.where(drafted, np.minimum(accepted + 1, verified), 0)
        observed = positions < seen[:, None]
        outcomes = (positions < accepted[:, None]).astype(np.float64)
        # What this step observed: the calibrated confidences of the drafted block, or without
        # them the outcomes. An undrafted request moves `idle_relax` of the way to its mean.
        cells, value = ((drafted[:, None] & (positions < limit), alpha) if confidence is not None
                        else (observed, outcomes))
        idle = ~drafted[:, None]
        estimate = np.where(cells, (1 - self.estimate_decay) * estimate + self.estimate_decay * value,
                            np.where(idle, estimate + self.idle_relax * (mean - estimate), estimate))
        mean = np.where(cells, (1 - self.mean_decay) * mean + self.mean_decay * value, mean)
        self.calibrator.observe(modes, confidence, outcomes, observed)
        if confidence is not None:
            self.calibrator.observe_drafted(modes, alpha, drafted[:, None] & (positions < limit))
        steps = self.learning_rate * np.where(observed, outcomes - alpha, 0.0).sum(axis=1)
        for i, state in enumerate(states):
            state.estimate, state.mean = estimate[i], mean[i]
            state.idle = 0 if drafted[i] else state.idle + 1
            if seen[i]:
                state.bias = float(np.clip(state.bias + steps[i], -3, 3))
