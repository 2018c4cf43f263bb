"""The verify-length objectives: tokens per second (a server) and the batch's end (an offline
batch's last requests), and the budget cap."""

import itertools

import numpy as np
import pytest

from sgl_dflash.speculative.adaptive import AdaptivePolicy
from sgl_dflash.speculative.allocation import Makespan, Throughput, best_lengths, cap_to_budget
from sgl_dflash.speculative.cost_model import step_shape


def by_rows(per_row: float, fixed: float):
    return lambda shape: fixed + per_row * shape[1]


def test_makespan_advance_is_the_expected_step_of_the_batch_end():
    """Against every joint outcome of the requests' drafts: E[max_i r_i - max_i (r_i - adv_i)]."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, num_positions = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        remaining = rng.integers(1, 6, n)
        gains = cap_to_budget(np.cumprod(rng.uniform(0.05, 0.95, (n, num_positions)), axis=1), remaining)
        k = rng.integers(0, num_positions + 1, n)
        # P(adv_i = a) for a = 1 .. P+1, from P(adv_i > m) = gains[i, m-1] for m <= k_i.
        more = [np.concatenate([[1.0], np.where(np.arange(num_positions) < k[i], gains[i], 0.0), [0.0]])
                for i in range(n)]
        expected = 0.0
        for advances in itertools.product(range(1, num_positions + 2), repeat=n):
            p = np.prod([more[i][a - 1] - more[i][a] for i, a in enumerate(advances)])
            expected += p * (remaining.max() - max(r - a for r, a in zip(remaining, advances)))
        assert Makespan(remaining, 1.0, 0.1).advance(gains, k) == pytest.approx(expected)


def test_a_tied_batch_runs_plain_where_tokens_per_second_would_draft():
    """8 requests with the same budget: a draft step makes 4.8 more tokens, but the batch ends
    only when all 8 do, and all 8 pass their draft with probability 0.6^8: not worth 4 more rows."""
    gains = np.cumprod(np.full((8, 3), 0.6), axis=1)
    cost = by_rows(0.5, fixed=7.0)  # a plain step: 11, a = 7, b = 0.5
    k, rate = best_lengths(gains, cost)
    assert k.sum() == 8 and rate > 8 / cost(step_shape(np.ones(8)))  # tokens per second drafts
    plain = cost(step_shape(np.ones(8)))
    k, score = best_lengths(gains, cost, Makespan(np.full(8, 100), plain, per_token=0.5))
    assert k.sum() == 0 and score == pytest.approx(1.0)  # a plain step saves what it costs


def test_the_request_furthest_from_its_end_gets_the_drafts():
    """One request 20 tokens behind the others: its drafts bring the batch's end closer, the
    others' only save their rows. Tokens per second, blind to that, drafts the likelier ones."""
    alpha = np.full((8, 3), 0.7)
    alpha[5] = 0.6  # the straggler's drafts are a little less likely
    gains = np.cumprod(alpha, axis=1)
    remaining = np.full(8, 80)
    remaining[5] = 100
    cost = by_rows(0.5, fixed=7.0)
    plain = cost(step_shape(np.ones(8)))
    k, score = best_lengths(gains, cost, Makespan(remaining, plain, per_token=0.5))
    assert k[5] == 3 and score > 1.0
    k, _ = best_lengths(gains, cost, Throughput())
    assert k[5] < 3


def test_one_request_is_chosen_for_as_by_tokens_per_second():
    rng = np.random.default_rng(1)
    for _ in range(50):
        gains = np.cumprod(rng.uniform(0.05, 0.95, (1, 7)), axis=1)
        fixed, per_row = rng.uniform(1.0, 10.0), rng.uniform(0.1, 2.0)
        cost = by_rows(per_row, fixed)
        plain = cost(step_shape(np.ones(1)))
        k, _ = best_lengths(gains, cost, Makespan(np.array([50]), plain, per_token=per_row))
        assert k.tolist() == best_lengths(gains, cost)[0].tolist()


def test_no_drafts_past_a_requests_budget():
    gains = np.cumprod(np.full((3, 7), 0.9), axis=1)
    capped = cap_to_budget(gains, np.array([1, 3, 100]))
    assert (capped[0] == 0).all()  # its last token: the bonus alone
    assert (capped[1, :2] > 0).all() and (capped[1, 2:] == 0).all()  # 2 drafts + bonus = 3 tokens
    assert (capped[2] == gains[2]).all()
    k, _ = best_lengths(capped, lambda shape: 1.0)  # verifying is free: all it can use
    assert k.tolist() == [0, 2, 7]


def test_the_policy_plans_a_closed_batch_by_its_end():
    """The same policy and estimates: a server's step drafts, the closed batch's runs plain, and
    the batch's straggler gets its whole block."""
    policy = AdaptivePolicy(num_drafts=3, explore_every=0, probe_every=1000)
    slots = list(range(8))
    for slot in slots:
        policy.add(slot)
        policy.requests[slot].estimate = np.full(3, 0.6)
    for shape, seconds in (((8, 8, 1), 11.0), ((8, 16, 2), 15.0), ((8, 32, 4), 23.0)):
        for _ in range(3):
            policy.cost.observe(shape, seconds, 8, 0.2, 0.0, draft_block=2)
            policy.cost.observe(shape, seconds, 8, 0.2, 0.0, draft_block=4)  # (a draft of 8: 0.2 s)
    tied = np.full(8, 100)
    assert policy.plan_drafts(slots, tied).block > 0  # tokens per second: drafting pays
    assert policy.plan_drafts(slots, tied, closed=True).block == 0
    behind = tied.copy()
    behind[3] = 130
    plan = policy.plan_drafts(slots, behind, closed=True)
    assert plan.block == 4 and plan.drafted[3]  # (the others fill the step's free rows)
    confidence = np.full((8, 3), 0.6)
    k = policy.choose(slots, np.zeros(8, np.int64), plan.drafted, confidence, 0.2, plan.block, behind, closed=True)
    assert k[3] == 3 and k.sum() <= 8  # the straggler's whole block, in the 16-row step
