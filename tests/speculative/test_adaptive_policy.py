"""The adaptive policy's parts on their own: the length optimizer, calibration, cost model, plan."""

import statistics

import numpy as np
import pytest

from sgl_dflash.speculative.adaptive import GREEDY, SAMPLED, AdaptivePolicy, Calibrator, best_lengths
from sgl_dflash.speculative.cost_model import CostModel, step_shape
from sgl_dflash.speculative.realized import RealizedGains


def by_rows(per_row: float, fixed: float = 0.0):
    """A step cost that grows with the bucketed token rows T of the step's (S, T, Q) shape."""
    return lambda shape: fixed + per_row * shape[1]


def test_step_shape_matches_the_runner_buckets():
    assert step_shape(np.array([1])) == (1, 2, 1)  # >= 2 token rows
    assert step_shape(np.array([1, 1, 1])) == (4, 4, 1)
    assert step_shape(np.array([3, 1, 1])) == (4, 8, 4)
    assert step_shape(np.array([8] * 32)) == (32, 256, 8)


def test_free_rows_are_filled_and_costly_rows_refused():
    gains = np.cumprod(np.full((3, 7), 0.9), axis=1)
    k, rate = best_lengths(gains, lambda q: 1.0)  # a flat cost: verify everything
    assert k.tolist() == [7, 7, 7] and rate == pytest.approx(3 + gains.sum())
    k, _ = best_lengths(gains, by_rows(1.0))  # every row costs as much as a token is worth...
    assert k.tolist() == [1, 0, 0]  # ...but 3 requests run in 4 rows anyway: one draft is free
    k, _ = best_lengths(np.cumprod(np.full((4, 7), 0.9), axis=1), by_rows(1.0))
    assert k.tolist() == [0, 0, 0, 0]
    # One request alone: the AR step already pays for 2 rows, so one draft rides for free.
    k, _ = best_lengths(np.cumprod(np.full((1, 7), 0.1), axis=1), by_rows(1.0, fixed=10.0))
    assert k.tolist() == [1]


def test_drafts_go_to_the_most_promising_requests_as_prefixes():
    alpha = np.array([[0.95] * 7, [0.2] * 7, [0.9, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9], [0.5] * 7])
    gains = np.cumprod(alpha, axis=1)
    # Rows beyond the AR step's 4 cost 0.3 each up to 8, then a lot: the best 4 drafts fit.
    cost = lambda shape: {4: 4.0, 8: 5.2}.get(shape[1], 100.0)  # noqa: E731
    k, _ = best_lengths(gains, cost)
    assert k.sum() == 4 and k[1] == 0
    assert k[0] >= k[3] and k[2] <= 2  # the 0.1 at position 3 stops request 2's prefix
    for i in range(4):  # a verified draft's predecessors are verified too (prefix)
        assert all(gains[i, m] >= gains[j, m2] for m in range(k[i]) for j in range(4) for m2 in range(k[j], 7))


def test_best_lengths_finds_the_best_allocation_of_any_shape():
    """Against every allocation (k_i in 0..P per request), each priced at `step_shape(k + 1)`:
    with a cost that grows with the shape, the optimizer's rate is the best there is."""
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(60):
        n, num_positions = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        gains = np.cumprod(rng.uniform(0.05, 0.95, (n, num_positions)), axis=1)
        a, per_row, per_query = rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.5), rng.uniform(0.0, 0.5)
        cost = lambda shape: a + per_row * shape[1] + per_query * shape[2]  # noqa: B023, E731
        best = max((n + sum(gains[i, :k[i]].sum() for i in range(n))) / cost(step_shape(np.array(k) + 1))
                   for k in itertools.product(range(num_positions + 1), repeat=n))
        k, rate = best_lengths(gains, cost)
        assert rate == pytest.approx(best)
        assert rate == pytest.approx((n + sum(gains[i, :k[i]].sum() for i in range(n))) / cost(step_shape(k + 1)))


@pytest.mark.parametrize("block_size", [4, 6, 8, 12, 16])
def test_one_set_of_allocations_serves_every_draft_block(block_size):
    """The plan weighs each draft block b on the allocations of the full block capped below 2b
    (computed once a step): the same choice, rate included, as `best_lengths` on gains[:, :b-1]."""
    from sgl_dflash.speculative.adaptive import allocations, draft_blocks

    rng = np.random.default_rng(block_size)
    for _ in range(200):
        n = int(rng.integers(1, 20))
        gains = np.cumprod(np.where(rng.random((n, block_size - 1)) < 0.1, 0.0, rng.random((n, block_size - 1))), axis=1)
        if rng.random() < 0.3:
            gains = np.round(gains, 1)  # ties
        per_row, fixed = rng.random() * 0.01, rng.random() * 0.2
        candidates = allocations(gains)
        for b in draft_blocks(block_size):
            def cost(shape, extra=rng.random() * 0.05):
                return fixed + extra + per_row * shape[1] + 0.001 * shape[2]
            k, rate = best_lengths(gains[:, : b - 1], cost)
            shared_k, shared_rate = best_lengths(gains[:, : b - 1], cost, [a for a in candidates if a.cap < 2 * b])
            assert rate == shared_rate and k.tolist() == shared_k.tolist()


def test_calibrator_learns_from_outcomes():
    cal = Calibrator(num_positions=3)
    conf = np.array([[0.95, 0.95, 0.95]])
    prior = cal.alpha(np.array([GREEDY]), conf)[0]
    assert prior == pytest.approx([0.95] * 3)
    for _ in range(50):  # confident drafts that the target rejects at position 1
        cal.observe(np.array([GREEDY]), conf, np.array([[1.0, 0.0, 0.0]]), np.array([[True, True, False]]))
    after = cal.alpha(np.array([GREEDY]), conf)[0]
    assert after[0] > 0.95 and after[1] < 0.2 and after[2] == pytest.approx(0.95)  # 3 never seen
    assert cal.alpha(np.array([SAMPLED]), conf)[0] == pytest.approx(prior)  # modes are separate
    # A new request's estimate: the outcomes per position (not the prior of 10 confidence bins).
    means = cal.position_means(GREEDY)
    assert means[0] > 0.95 and means[1] < 0.05 and means[2] == pytest.approx(0.5)
    cal.observe(np.array([SAMPLED]), None, np.array([[1.0, 0.0, 0.0]]), np.array([[True, False, False]]))  # positions only
    assert cal.position_means(SAMPLED)[0] == pytest.approx(2 / 3)
    assert cal.alpha(np.array([SAMPLED]), conf)[0] == pytest.approx(prior)


def test_cost_model_measures_and_predicts():
    cost = CostModel(window=3)
    assert cost.verify((1, 2, 1)) < cost.verify((1, 8, 8))  # the prior already grows with rows
    cost.observe((4, 4, 1), 0.10, 0, 0.0, 0.01)
    cost.observe((4, 16, 4), 0.22, 4, 0.02, 0.01, draft_block=4)
    assert cost.verify((4, 4, 1)) == pytest.approx(0.10)
    assert cost.verify((4, 32, 8)) == pytest.approx(0.10 + 0.01 * 28)  # the line through both
    assert cost.draft(3, 4) == pytest.approx(0.02) and cost.draft(16, 4) == pytest.approx(0.04)
    assert cost.draft(4, 16) == pytest.approx(0.04)  # nearest measured, by batch x block
    cost.observe((4, 4, 1), 0.20, 0, 0.0, 0.01)
    assert cost.verify((4, 4, 1)) == pytest.approx(0.15)  # the median of the last `window`
    cost.observe((4, 4, 1), 5.0, 0, 0.0, 0.01)  # an outlier (another process's burst)...
    assert cost.verify((4, 4, 1)) == pytest.approx(0.20)  # ...moves the cost only to a real value
    for _ in range(2):
        cost.observe((4, 4, 1), 0.3, 0, 0.0, 0.01)
    assert cost.verify((4, 4, 1)) == pytest.approx(0.3)  # the window follows a lasting change
    # The machine's speed is the clock: the plain step, settled at 0.2, now reads 0.3, so what was
    # measured before (at speed 1) is predicted 1.5x as costly.
    assert cost.speed == pytest.approx(1.5)
    zero = CostModel()
    for _ in range(4):  # a reading of 0 s (a timer's resolution) neither divides by zero nor sets the speed
        zero.observe((4, 4, 1), 0.0, 0, 0.0, 0.0)
    assert zero.speed == 1.0 and zero.verify((4, 4, 1)) == 0.0
    assert cost.verify((4, 16, 4)) == pytest.approx(0.22 * 1.5) and cost.draft(3, 4) == pytest.approx(0.02 * 1.5)


def test_the_clock_is_trusted_after_three_readings():
    """A program read once or twice tells nothing of the machine's speed (one outlier is its
    median): readings taken beside it are kept as they are, and the policy runs plain steps until
    the plain step has three."""
    cost = CostModel()
    cost.observe((4, 4, 1), 0.30, 0, 0.0, 0.0)  # the first plain step: an outlier
    cost.observe((4, 16, 4), 0.22, 4, 0.02, 0.0, draft_block=4)
    for _ in range(2):
        cost.observe((4, 4, 1), 0.10, 0, 0.0, 0.0)
    assert cost.verify((4, 4, 1)) == pytest.approx(0.10)
    assert cost.verify((4, 16, 4)) == pytest.approx(0.22)  # not 0.22 / 3: it was read against no clock
    cost.observe((4, 16, 4), 0.24, 4, 0.02, 0.0, draft_block=4)
    assert cost.speed == 1.0  # no program settled yet
    cost.observe((4, 4, 1), 0.20, 0, 0.0, 0.0)  # the settled plain step (0.10) reads 0.20: speed 2
    cost.observe((4, 4, 1), 0.20, 0, 0.0, 0.0)
    assert cost.speed == pytest.approx(2.0) and cost.verify((4, 4, 1)) == pytest.approx(0.20)
    assert cost.verify((4, 16, 4)) == pytest.approx(2 * statistics.median([0.22, 0.24]))  # read at speed 1

    policy = AdaptivePolicy(num_drafts=7, explore_every=0, probe_every=1000, min_gain=0.0)
    for slot in range(4):
        policy.add(slot)
        policy.requests[slot].estimate[:] = 0.9
    policy.cost.compiled_verify.update({(4, 4, 1), (4, 16, 4)})
    policy.cost.compiled_draft.add((4, 4))
    policy.cost.observe((4, 16, 4), 0.12, 4, 0.01, 0.0, draft_block=4)
    blocks = []
    for _ in range(4):
        blocks.append(policy.plan_drafts(range(4)).block)
        if not blocks[-1]:
            policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
    assert blocks[:3] == [0, 0, 0] and blocks[3]  # three plain readings first, then drafting (which pays)


def test_plan_skips_the_drafter_when_drafts_do_not_pay_and_probes_idle_requests():
    policy = AdaptivePolicy(num_drafts=7, probe_every=4, explore_every=0)
    slots = [0, 1, 2, 3]
    for slot in slots:
        policy.add(slot)
    for _ in range(3):  # measured: 4 AR rows 0.1 s, 8 rows 0.12 s, drafting 8 tokens 0.05 s
        policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
        policy.cost.observe((4, 8, 2), 0.12, 4, 0.05, 0.0, draft_block=8)
    for slot in slots:  # requests whose drafts are never accepted
        policy.requests[slot].estimate[:] = 0.05
    plan = policy.plan_drafts(slots)
    assert not plan.drafted.any() and plan.block == 0
    for _ in range(3):
        policy.observe(slots, np.zeros(4, np.int64), np.zeros(4, bool), None, np.zeros(4), np.zeros(4))
    policy.cost.at(16, 128)  # a context where nothing was compiled: probes would compile, none run
    assert policy.plan_drafts(slots).block == 0
    policy.cost.at(0, 0)
    policy.cost.compiled_draft.add((4, 2))  # (as the startup sweep does)
    plan = policy.plan_drafts(slots)
    # Idle for probe_every steps (their estimates relaxed towards 0.5): probed, at the block
    # closest to paying (2: 5.2 tokens in 0.145 s, 0.9x the plain step's rate).
    assert plan.drafted.all() and plan.block == 2

    for slot in slots:  # (drafts that never pass: not even the verify's padding rows take them)
        policy.requests[slot].estimate[:] = 0.0
    policy.requests[0].estimate[:] = 0.99  # one good request: drafted (its bucket of 1)
    policy.requests[0].idle = policy.requests[1].idle = policy.requests[2].idle = policy.requests[3].idle = 0
    policy.cost.observe((4, 8, 8), 0.1, 1, 0.001, 0.0, draft_block=8)
    plan = policy.plan_drafts(slots)
    assert plan.drafted.tolist() == [True, False, False, False] and plan.block == 8


def test_plan_chooses_the_draft_block_by_its_cost():
    """Drafts past the first rarely pass: the cheap block of 2 wins over the drafter's 8, unless
    the block of 8 costs no more to draft and verify."""
    policy = AdaptivePolicy(num_drafts=7, explore_every=0, refresh_every=0)  # (refresh: its own test)
    slots = [0, 1, 2, 3]
    for slot in slots:
        policy.add(slot)
        policy.requests[slot].estimate[:] = [0.9] + [0.3] * 6
    for _ in range(3):  # 4 rows 0.1 s, 8 rows 0.12 s, 32 rows 0.4 s; drafting 8 costs 4x drafting 2
        policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
        policy.cost.observe((4, 8, 2), 0.12, 4, 0.01, 0.0, draft_block=2)
        policy.cost.observe((4, 32, 8), 0.4, 4, 0.04, 0.0, draft_block=8)
        policy.cost.observe((4, 16, 4), 0.2, 4, 0.02, 0.0, draft_block=4)
    plan = policy.plan_drafts(slots)
    assert plan.drafted.all() and plan.block == 2
    for _ in range(40):  # now the long block is as cheap as the short one (which, like the plain step,
        # still costs what it did: with only the long blocks measured faster, the model reads a faster
        # machine, test_costs_follow_the_machine)
        policy.cost.observe((4, 32, 8), 0.12, 4, 0.01, 0.0, draft_block=8)
        policy.cost.observe((4, 16, 4), 0.12, 4, 0.01, 0.0, draft_block=4)
        policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
        policy.cost.observe((4, 8, 2), 0.12, 4, 0.01, 0.0, draft_block=2)
    assert policy.plan_drafts(slots).block == 8


def exploring_policy(compile_s: float) -> AdaptivePolicy:
    policy = AdaptivePolicy(num_drafts=7, explore_every=4)
    for slot in range(4):
        policy.add(slot)
        policy.requests[slot].estimate[:] = 0.9
    for _ in range(3):  # only the full draft block was ever measured
        policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
        policy.cost.observe((4, 32, 8), 0.3, 4, 0.01, 0.0, draft_block=8)
        policy.cost.observe((4, 16, 8), 0.25, 4, 0.01, 0.0, draft_block=8)
    policy.cost.compiled((4, 16, 4), 4, 4, compile_s)  # ran once, while compiling
    return policy


def test_exploration_tries_an_unmeasured_shape():
    """Every `explore_every`-th step a compiled but unmeasured draft block that may be better
    (predicted within the discount) is tried, so that its measurement decides from then on."""
    policy = exploring_policy(compile_s=1.0)
    blocks = [policy.plan_drafts(range(4)).block for _ in range(4)]
    assert blocks == [8, 8, 8, 4]  # the 4th step explores the block of 4
    policy.cost.observe((4, 16, 4), 0.25, 4, 0.01, 0.0, draft_block=4)
    assert policy.plan_drafts(range(4)).block == 8  # measured: no better


def test_a_shape_never_run_pays_for_its_compile():
    """The same choice, but the block of 4 never ran: its prediction carries a share of the
    measured compile time, and a young server does not explore it (a compile stalls a step)."""
    policy = exploring_policy(compile_s=30.0)
    policy.cost.compiled_verify.discard((4, 16, 4))
    policy.cost.compiled_draft.discard((4, 4))
    assert [policy.plan_drafts(range(4)).block for _ in range(4)] == [8, 8, 8, 8]
    predicted = policy.cost.draft(4, 4)
    policy.steps = 5  # not an exploring step
    assert policy.draft_cost(4, 4) == pytest.approx(predicted + 30.0 / 64)  # a young server: 64 steps
    while policy.cost.steps_here() < 641:
        policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
    assert policy.draft_cost(4, 4) == pytest.approx(predicted + 30.0 / 641)  # ran N steps: N more
    assert policy.draft_cost(4, 8) == pytest.approx(policy.cost.draft(4, 8))  # compiled: no share


def test_programs_compile_per_context_and_a_new_context_is_young():
    """A verify shape is compiled per page-table width and a draft per drafter window: at a
    context never run, nothing is compiled, and the steps run at other widths do not amortize
    its compiles (a batch that just crossed into it may leave it soon)."""
    policy = exploring_policy(compile_s=30.0)
    for _ in range(700):
        policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
    policy.steps = 5
    assert policy.draft_cost(4, 8) == pytest.approx(policy.cost.draft(4, 8))
    policy.cost.at(32, 512)
    assert policy.cost.compiled_verify == set() and policy.cost.compiled_draft == set()
    assert policy.draft_cost(4, 8) == pytest.approx(policy.cost.draft(4, 8) + 30.0 / 64)
    policy.cost.compiled_verify.add((4, 4, 1))  # a plain step ran here: drafting would compile
    assert [policy.plan_drafts(range(4)).block for _ in range(4)] == [0, 0, 0, 0]
    policy.cost.at(0, 0)  # back where they ran: compiled, and drafting pays
    assert (4, 8) in policy.cost.compiled_draft and policy.plan_drafts(range(4)).block == 8


def test_a_long_running_server_explores_a_shape_never_compiled():
    """Else a shape ruled out by the line's guess is never measured. Once the compile's share is
    small (a server that ran many steps), an exploring step tries it, and its measurement
    decides from then on."""
    policy = exploring_policy(compile_s=1.0)
    policy.cost.compiled_verify.discard((4, 16, 4))
    policy.cost.compiled_draft.discard((4, 4))
    policy.steps = 4000
    policy.cost._steps_at[policy.cost.width] = 4000  # (as many observed would make the readings stale)
    blocks = [policy.plan_drafts(range(4)).block for _ in range(4)]
    assert blocks == [8, 8, 8, 4]  # step 4004 explores (explore_every=4), compiling the block of 4
    policy.cost.observe((4, 16, 4), 0.25, 4, 0.01, 0.0, draft_block=4)
    assert policy.plan_drafts(range(4)).block == 8  # measured: no better


def test_near_the_mapping_limit_nothing_new_is_compiled():
    """jax_backend.compiled_memory: past the process's room for programs, a compile would kill the
    server, so a shape or draft program never compiled is out of reach, exploring or not; the
    compiled ones keep serving, and the plain step (a request needs it) stays priced."""
    policy = exploring_policy(compile_s=1.0)
    policy.cost.compiled_verify.discard((4, 16, 4))
    policy.cost.compiled_draft.discard((4, 4))
    policy.steps = 4000
    policy.cost._steps_at[policy.cost.width] = 4000
    policy.may_compile = False
    assert [policy.plan_drafts(range(4)).block for _ in range(8)] == [8] * 8  # the explorations kept to 8
    assert policy.shape_cost((4, 16, 4)) == float("inf") and policy.draft_cost(4, 4) == float("inf")
    policy.cost.compiled_verify.discard((8, 8, 1))
    assert policy.shape_cost((8, 8, 1)) < float("inf")  # a plain step of a new batch still compiles
    policy.may_compile = True
    assert [policy.plan_drafts(range(4)).block for _ in range(4)] == [8, 8, 8, 4]


def test_request_bias_follows_its_outcomes():
    policy = AdaptivePolicy(num_drafts=3)
    policy.add(7)
    conf = np.array([[0.5, 0.5, 0.5]])
    before = policy.alphas([7], np.array([GREEDY]), conf)[0, 0]
    for _ in range(5):  # this request's drafts always pass
        policy.observe([7], np.array([GREEDY]), np.array([True]), conf, np.array([3]), np.array([3]))
    estimate = policy.requests[7].estimate.copy()
    policy.observe([7], np.array([GREEDY]), np.array([True]), np.array([[0.99, 0.0, 0.0]]), np.array([1]),
                   np.array([1]), block=2)
    assert policy.requests[7].estimate[1:].tolist() == estimate[1:].tolist()  # undrafted positions kept
    assert policy.alphas([7], np.array([GREEDY]), conf)[0, 0] > before
    policy.add(8)  # a new request starts from the (shared) calibration, without the bias
    assert policy.requests[8].bias == 0.0


def _serve_steps(policy: AdaptivePolicy, slots: list[int], steps: int, drafted: tuple[float, float],
                 plain: float) -> list[int]:
    """Plans `steps` steps of 4 requests, each measured as its plan chose: a drafted step as a
    verify of one draft per request (8 rows) and a draft of `drafted` seconds, a plain step as
    `plain` seconds. The blocks planned."""
    blocks = []
    for _ in range(steps):
        blocks.append(policy.plan_drafts(slots).block)
        if blocks[-1]:
            policy.cost.observe((4, 8, 2), drafted[0], 4, drafted[1], 0.0, draft_block=blocks[-1])
        else:
            policy.cost.observe((4, 4, 1), plain, 0, 0.0, 0.0)
    return blocks


def test_a_stale_plain_cost_is_measured_again():
    """Drafting stops the plain step's cost from being measured: a reading inflated by a burst
    of load would keep the policy drafting. Every `refresh_every` steps a step that would draft
    runs plain; measured cheap, the policy stops drafting."""
    policy = AdaptivePolicy(num_drafts=7, explore_every=0, probe_every=1000, refresh_every=4, min_gain=0.0,
                            cost_model=CostModel(min_clock_readings=1))  # (one reading is the clock here)
    slots = [0, 1, 2, 3]
    for slot in slots:
        policy.add(slot)
        policy.requests[slot].estimate[:] = [0.5] + [0.1] * 6
    policy.cost.observe((4, 4, 1), 0.3, 0, 0.0, 0.0)  # a plain step during a burst
    plans = []
    for _ in range(4):
        plan = policy.plan_drafts(slots)
        plans.append(plan.block)
        if plan.block:  # drafting 2 tokens: 8 rows at 0.2 s
            policy.cost.observe((4, 8, 2), 0.2, 4, 0.01, 0.0, draft_block=plan.block)
    assert plans == [2, 2, 2, 0]  # the 4th step would draft, but the plain cost is 4 steps old
    for _ in range(5):  # measured again: 0.1 s, the burst is over
        policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
    # The drafted step was read beside the burst's plain step, as 2/3 of it: it drafts, reads
    # the drafted step at 2x the plain one now, and stops drafting within a few steps for good.
    plans = _serve_steps(policy, slots, 12, drafted=(0.2, 0.01), plain=0.1)
    assert plans[6:] == [0] * 6

    policy = AdaptivePolicy(num_drafts=7, explore_every=0, probe_every=1000, refresh_every=4, min_gain=0.0,
                            cost_model=CostModel(min_clock_readings=1))  # (one reading is the clock here)
    for slot in slots:
        policy.add(slot)
        policy.requests[slot].estimate[:] = [0.5] + [0.1] * 6
    policy.cost.observe((4, 4, 1), 0.3, 0, 0.0, 0.0)
    policy.cost.compiled_verify.discard((4, 4, 1))  # a plain step that would compile...
    plans = []
    for _ in range(8):
        plans.append(policy.plan_drafts(slots).block)
        policy.cost.observe((4, 8, 2), 0.2, 4, 0.01, 0.0, draft_block=2)
    assert plans == [2] * 8  # ...is never forced


def test_a_stale_drafted_cost_is_measured_again():
    """The machine's speed drifts; a drafted shape measured while it was slow would never be
    chosen again, hence never measured again. Once its measurement is `stale_after` steps old,
    exploring steps try it, and the new measurement replaces the old ones (one fresh sample could
    not move a median of nine)."""
    policy = AdaptivePolicy(num_drafts=7, explore_every=4, probe_every=1000, refresh_every=0, min_gain=0.0)
    policy.cost.stale_after = 20
    slots = [0, 1, 2, 3]
    for slot in slots:
        policy.add(slot)
        policy.requests[slot].estimate[:] = [0.5] + [0.1] * 6
    for _ in range(9):  # drafting 2 tokens while the machine was slow: 0.2 s
        policy.cost.observe((4, 8, 2), 0.2, 4, 0.01, 0.0, draft_block=2)
    policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
    blocks = _serve_steps(policy, slots, 40, drafted=(0.11, 0.01), plain=0.1)  # the machine is fast again
    first = blocks.index(2)
    assert first >= 19  # not before the slow reading is stale
    # Measured again, drafting pays and it keeps drafting (until the plain cost, unmeasured
    # meanwhile, is stale in turn and an exploring step measures it again).
    assert first + 16 < len(blocks) and set(blocks[first : first + 16]) == {2}


def test_costs_follow_the_machine():
    """A drafted shape measured while the machine ran 1.5x slower is predicted at today's speed
    once later steps (of any shape) read the faster machine. Without the shared drift, its old
    reading (never refreshed: it is only measured when chosen) kept the policy plain where
    drafting paid (MT-Bench at one request after the mixed rows: 33.2 ms held vs 20.6 measured)."""
    policy = AdaptivePolicy(num_drafts=7, explore_every=0, probe_every=1000, refresh_every=0)
    policy.add(0)
    policy.requests[0].estimate[:] = [0.7, 0.6, 0.5] + [0.1] * 4
    for _ in range(9):  # the machine at 1.5x: plain 0.027 s, a 4-token verify 0.031 s, drafting 0.0075 s
        policy.cost.observe((1, 2, 1), 0.027, 0, 0.0, 0.0)
        policy.cost.observe((1, 4, 4), 0.031, 1, 0.0075, 0.0, draft_block=4)
    for _ in range(20):  # back to full speed, plain steps only: 0.018 s
        policy.cost.observe((1, 2, 1), 0.018, 0, 0.0, 0.0)
    assert policy.cost.verify((1, 4, 4)) == pytest.approx(0.031 * 2 / 3)
    assert policy.cost.draft(1, 4) == pytest.approx(0.0075 * 2 / 3)
    # 1 + 0.7 + 0.42 + 0.21 tokens in 0.0257 s beats 1 token in 0.018 s: it drafts again.
    assert policy.plan_drafts([0]).block == 4


def test_a_slow_spell_read_on_drafted_steps_moves_the_plain_prediction_too():
    """While the policy drafts, only drafted programs are read. A slow spell they read is the
    machine's, so the plain step is predicted slower too and drafting, which still pays, goes on.
    With the plain step as the clock (until 2026-11-27) the drafted step looked 1.6x a plain step
    here instead of 1.33x, and at 32 requests the policy ran plain steps where drafting paid."""
    policy = AdaptivePolicy(num_drafts=7, explore_every=0, probe_every=1000, refresh_every=0)
    slots = [0, 1, 2, 3]
    for slot in slots:
        policy.add(slot)
        policy.requests[slot].estimate[:] = [0.6] + [0.05] * 6
    for _ in range(5):  # settled at full speed: plain 0.30 s; one draft each 0.40 s + 0.02 s drafting
        policy.cost.observe((4, 4, 1), 0.30, 0, 0.0, 0.0)
        policy.cost.observe((4, 8, 2), 0.40, 4, 0.02, 0.0, draft_block=2)
    blocks = _serve_steps(policy, slots, 8, drafted=(0.48, 0.024), plain=0.36)  # the machine at 1.2x
    assert policy.cost.speed == pytest.approx(1.2)
    assert policy.cost.verify((4, 4, 1)) == pytest.approx(0.36)  # never read in the slow spell
    assert blocks == [2] * 8  # 6.4 tokens in 0.504 s beat 4 in 0.36 s by 13%


def test_a_plain_outlier_moves_no_clocked_cost():
    cost = CostModel()
    for _ in range(5):
        cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
        cost.observe((4, 8, 2), 0.12, 4, 0.01, 0.0, draft_block=2)
    cost.observe((4, 4, 1), 5.0, 0, 0.0, 0.0)  # another process's burst
    assert cost.verify((4, 4, 1)) == pytest.approx(0.1) and cost.verify((4, 8, 2)) == pytest.approx(0.12)
    assert cost.draft(4, 2) == pytest.approx(0.01)
    for _ in range(9):  # a lasting slowdown, read on the plain step alone, moves what was read beside it
        cost.observe((4, 4, 1), 0.2, 0, 0.0, 0.0)
    assert cost.verify((4, 8, 2)) == pytest.approx(0.24) and cost.draft(4, 2) == pytest.approx(0.02)
    assert cost.verify((8, 8, 1)) == pytest.approx(cost.line()[0] + 8 * cost.line()[1])  # unmeasured: the line


def test_probes_draft_the_block_closest_to_paying():
    """Idle requests are probed at the draft block the plan values most, not the smallest: the
    block a fixed B=4 wins with must get measured for the policy to find it."""
    policy = AdaptivePolicy(num_drafts=7, probe_every=2, explore_every=0, refresh_every=0)
    policy.add(0)
    policy.requests[0].estimate[:] = [0.5, 0.45, 0.4] + [0.05] * 4
    for _ in range(3):  # a plain step 0.02 s; drafting and verifying 2 or 4 tokens costs a little more than it yields
        policy.cost.observe((1, 2, 1), 0.02, 0, 0.0, 0.0)
        policy.cost.observe((1, 2, 2), 0.021, 1, 0.0125, 0.0, draft_block=2)
        policy.cost.observe((1, 4, 4), 0.026, 1, 0.0125, 0.0, draft_block=4)
        policy.cost.observe((1, 8, 8), 0.035, 1, 0.0125, 0.0, draft_block=8)
    assert policy.plan_drafts([0]).block == 0  # nothing pays
    policy.observe([0], np.zeros(1, np.int64), np.zeros(1, bool), None, np.zeros(1), np.zeros(1))
    plan = policy.plan_drafts([0])
    assert plan.drafted.all() and plan.block == 4  # 1.86 tokens in 0.0385 s beats 1.5 in 0.0335 s


def test_an_idle_estimate_returns_to_the_requests_mean():
    """One step of low confidence halves a request's estimate; while it is not drafted nothing
    observes it, so each idle step moves it back toward the request's long-run mean, and a request
    whose drafts usually pay is drafted again after a few plain steps, not only at its probe
    (gsm8k at one request: half the steps plain before, where drafting 3 gained 1.4x)."""
    def policy_after_a_bad_step(idle_relax):
        policy = AdaptivePolicy(num_drafts=3, probe_every=16, explore_every=0, refresh_every=0, idle_relax=idle_relax)
        policy.add(0)
        state = policy.requests[0]
        state.estimate[:] = state.mean[:] = 0.8  # a request whose drafts usually pass
        for _ in range(3):  # drafting 3 costs 1.5 plain steps: pays above ~0.3 per draft
            policy.cost.observe((1, 2, 1), 0.020, 0, 0.0, 0.0)
            policy.cost.observe((1, 4, 4), 0.026, 1, 0.004, 0.0, draft_block=4)
        assert policy.plan_drafts([0]).block == 4
        low = np.full((1, 3), 0.02)  # the drafter unsure of every draft this step
        for _ in range(2):
            policy.observe([0], np.zeros(1, np.int64), np.ones(1, bool), low, np.zeros(1), np.zeros(1), block=4)
        return policy

    def plain_steps_until_drafted(policy):
        for steps in range(16):
            if policy.plan_drafts([0]).block:
                return steps
            policy.observe([0], np.zeros(1, np.int64), np.zeros(1, bool), None, np.zeros(1), np.zeros(1))
        return 16

    relaxed = policy_after_a_bad_step(0.25)
    assert relaxed.plan_drafts([0]).block == 0  # the bad steps count: plain next
    assert 0.5 < relaxed.requests[0].mean[0] < 0.8  # and they moved the long-run mean a little
    assert 1 <= plain_steps_until_drafted(relaxed) <= 4
    assert plain_steps_until_drafted(policy_after_a_bad_step(0.0)) >= 14  # before: until the probe


def policy_with_a_small_gain(min_gain: float) -> AdaptivePolicy:
    """One request; drafting one draft (block 2) costs 1.4x a plain step and passes 1.47 times
    in 2: expected 1.47 / 1.4 = 1.05x the plain step's tokens per second."""
    policy = AdaptivePolicy(num_drafts=7, explore_every=0, refresh_every=0, probe_every=1000, min_gain=min_gain)
    policy.add(0)
    policy.requests[0].estimate[:] = [0.47] + [0.01] * 6
    for _ in range(3):
        policy.cost.observe((1, 2, 1), 0.020, 0, 0.0, 0.0)
        policy.cost.observe((1, 2, 2), 0.020, 1, 0.008, 0.0, draft_block=2)
        policy.cost.observe((1, 4, 4), 0.030, 1, 0.012, 0.0, draft_block=4)
        policy.cost.observe((1, 8, 8), 0.040, 1, 0.016, 0.0, draft_block=8)
    return policy


def test_a_plain_step_is_observed_as_the_idle_requests_of_a_drafted_one():
    """observe() of a step that drafted nothing takes a short path (every plain step runs it):
    each estimate relaxes and idles exactly as an undrafted request's in a drafted step."""
    rng = np.random.default_rng(5)
    plain, mixed = AdaptivePolicy(num_drafts=7), AdaptivePolicy(num_drafts=7)
    for policy in (plain, mixed):
        for slot in range(4):
            policy.add(slot)
    for slot in range(4):
        estimate, mean = rng.random(7), rng.random(7)
        for policy in (plain, mixed):
            policy.requests[slot].estimate, policy.requests[slot].mean = estimate.copy(), mean.copy()
    hits = plain.calibrator.hits.copy()
    plain.observe([0, 1, 2], np.zeros(3, np.int64), np.zeros(3, bool), np.zeros((3, 7)), np.zeros(3), np.zeros(3))
    mixed.observe([0, 1, 2, 3], np.zeros(4, np.int64), np.array([False, False, False, True]), rng.random((4, 7)),
                  np.array([0, 0, 0, 5]), np.array([0, 0, 0, 2]))
    for slot in range(3):
        assert plain.requests[slot].estimate.tolist() == mixed.requests[slot].estimate.tolist()
        assert plain.requests[slot].mean.tolist() == mixed.requests[slot].mean.tolist()
        assert plain.requests[slot].idle == mixed.requests[slot].idle == 1
    assert not np.array_equal(plain.requests[0].estimate, plain.requests[0].mean)  # moved, not jumped
    np.testing.assert_array_equal(plain.calibrator.hits, hits)


def test_drafting_must_beat_the_plain_step_by_a_margin():
    """A predicted gain smaller than the predictions' error is a coin toss that loses on average
    (batch 8 and 32 on this CPU): below `min_gain` the step runs plain."""
    assert policy_with_a_small_gain(0.0).plan_drafts([0]).block == 2
    assert policy_with_a_small_gain(0.03).plan_drafts([0]).block == 2
    assert policy_with_a_small_gain(0.08).plan_drafts([0]).block == 0


def test_hopeless_probes_are_not_run():
    """Where drafting loses even at a request's fair estimate (a large batch on a slow host), a
    long-idle request is not probed: the probe would only waste a step."""
    def probe_plan(draft_s):
        policy = AdaptivePolicy(num_drafts=7, probe_every=2, explore_every=0, refresh_every=0)
        policy.add(0)
        policy.requests[0].estimate[:] = 0.3
        for _ in range(3):
            policy.cost.observe((1, 2, 1), 0.020, 0, 0.0, 0.0)
            policy.cost.observe((1, 2, 2), 0.022, 1, draft_s, 0.0, draft_block=2)
        assert policy.plan_drafts([0]).block == 0
        policy.observe([0], np.zeros(1, np.int64), np.zeros(1, bool), None, np.zeros(1), np.zeros(1))
        return policy.plan_drafts([0])

    assert probe_plan(0.010).block == 2  # 1.3 tokens in 0.032 s: 0.81x the plain rate, probed
    assert probe_plan(0.030).block == 0  # 1.3 tokens in 0.052 s: 0.5x, not


@pytest.mark.parametrize("with_confidence, n", [(False, 6), (True, 2)])
def test_observing_a_batch_equals_observing_its_requests_one_by_one(with_confidence, n):
    """observe() updates all requests of a step at once (one vectorized pass); the result is what
    observing each request alone gives: estimates, means, offsets, idle counts and calibration.
    (With confidences, a step's calibrated alphas are read before any of its outcomes are learnt,
    so the two agree where the requests share no calibration cell: one greedy, one sampled.)"""
    rng = np.random.default_rng(3)
    P = 7
    together, alone = AdaptivePolicy(num_drafts=P), AdaptivePolicy(num_drafts=P)
    for policy in (together, alone):
        for slot in range(n):
            policy.add(slot, slot % 2)
    modes = np.arange(n) % 2
    for _ in range(40):
        drafted = rng.random(n) < 0.6
        block = int(rng.choice([2, 4, 8]))
        confidence = rng.random((n, P)) if with_confidence else None
        verified = np.where(drafted, rng.integers(0, block, n), 0)
        accepted = np.minimum(rng.integers(0, block, n), verified)
        together.observe(list(range(n)), modes, drafted, confidence, verified, accepted, block)
        for i in range(n):
            alone.observe([i], modes[i:i + 1], drafted[i:i + 1], None if confidence is None else confidence[i:i + 1],
                          verified[i:i + 1], accepted[i:i + 1], block)
    for slot in range(n):
        a, b = together.requests[slot], alone.requests[slot]
        np.testing.assert_allclose(a.estimate, b.estimate, rtol=0, atol=1e-12)
        np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=1e-12)
        assert a.bias == pytest.approx(b.bias, abs=1e-12) and a.idle == b.idle
    assert any(together.requests[s].bias != 0 for s in range(n))  # the offsets did learn
    for table in ("hits", "trials", "position_hits", "position_trials", "drafted_alpha", "drafted"):
        np.testing.assert_array_equal(getattr(together.calibrator, table), getattr(alone.calibrator, table))


def test_drafts_may_pay_where_a_typical_request_gains_at_that_load():
    """A joining request gets drafter context where a typical request's drafts (`typical_means`)
    beat the plain step at that load; before enough drafts were read, always."""
    policy = AdaptivePolicy(3)
    policy.draft_cost = lambda batch, block: 0.0
    policy.shape_cost = by_rows(1.0)  # a verify costs its token rows: drafts of 1 in 2 cannot pay
    assert policy.drafts_may_pay(8)  # no evidence yet
    outcomes = np.tile([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], (50, 1))  # first drafts pass 1 in 2
    policy.calibrator.observe(np.zeros(100, np.int64), None, outcomes, np.ones((100, 3), bool))
    assert not policy.drafts_may_pay(8) and not policy.drafts_may_pay(4)
    policy.shape_cost = by_rows(0.01, fixed=1.0)  # a step mostly fixed cost: drafts pay
    assert policy.drafts_may_pay(8) and policy.drafts_may_pay(32)
    policy.admit_ratio = 2.0  # but not twice the plain rate
    assert not policy.drafts_may_pay(8)
    # With confidences every drafted first position is evidence, verified or not: 32 of them.
    policy = AdaptivePolicy(3)
    policy.draft_cost = lambda batch, block: 0.0
    policy.shape_cost = by_rows(1.0)
    policy.add(0)
    for step in range(32):
        assert policy.drafts_may_pay(8)
        policy.observe([0], np.zeros(1, np.int64), np.array([True]), np.full((1, 3), 0.3), verified=np.array([0]),
                       accepted=np.array([0]), block=4)
    assert policy.calibrator.position_trials[GREEDY, 0] == 2.0 and not policy.drafts_may_pay(8)


def test_before_evidence_the_drafters_held_out_acceptance_prices_a_load():
    """With the drafter's held-out acceptance (`prior_acceptance`), a load is priced from the first
    request on (without it: yes until `admit_evidence` drafts, and a first batch of 32 got context
    for nothing); the drafts read here decide once there are enough of them."""
    policy = AdaptivePolicy(3, prior_acceptance=np.array([0.8, 0.75, 0.7]))
    policy.draft_cost = lambda batch, block: 0.0
    policy.shape_cost = by_rows(1.0)  # a verify costs its token rows: drafts below 1 cannot pay
    assert not policy.drafts_may_pay(32) and not policy.drafts_may_pay(8)
    policy.shape_cost = by_rows(0.01, fixed=1.0)  # rows nearly free: they pay
    assert policy.drafts_may_pay(32) and policy.drafts_may_pay(8)
    policy.prior_acceptance = np.array([0.01, 0.0, 0.0])  # a drafter measured to fail: not even then
    assert not policy.drafts_may_pay(8)
    policy.prior_acceptance = None
    assert policy.drafts_may_pay(8)  # no prior: yes until evidence
    policy.prior_acceptance = np.array([0.01, 0.0, 0.0])
    outcomes = np.ones((40, 3))  # 40 first drafts read here, every one passed: they decide
    policy.calibrator.observe(np.zeros(40, np.int64), None, outcomes, np.ones((40, 3), bool))
    assert policy.drafts_may_pay(8)


def test_a_typical_request_is_judged_by_every_draft_not_only_the_verified_ones():
    """The policy verifies confident drafts, so the outcomes it observes lean high for a typical
    request; the typical acceptance per position (what `drafts_may_pay` reads) is the calibrated
    acceptance of every draft drafted there, once 16 were."""
    policy = AdaptivePolicy(num_drafts=3)
    for slot in range(2):
        policy.add(slot)
    confidence = np.array([[0.95] * 3, [0.15] * 3])  # request 0 confident, request 1 not
    alphas = []
    for step in range(20):
        alphas.append(policy.alphas([0, 1], np.zeros(2, np.int64), confidence))
        # Both drafted; only the confident one verified (all 3 pass), the other ran a plain step.
        policy.observe([0, 1], np.zeros(2, np.int64), np.array([True, True]), confidence,
                       verified=np.array([3, 0]), accepted=np.array([3, 0]), block=4)
        cal = policy.calibrator
        if step < 7:  # fewer than 16 drafts per position: the outcomes stand in
            np.testing.assert_array_equal(cal.typical_means(GREEDY), cal.position_means(GREEDY))
    assert cal.position_means(GREEDY)[0] > 0.9  # what was verified passed
    typical = cal.typical_means(GREEDY)
    np.testing.assert_allclose(typical, np.mean(np.concatenate(alphas), axis=0), rtol=1e-12)
    assert 0.4 < typical[0] < 0.7  # half the drafts were doubtful


def test_startup_readings_decide_a_load_not_served_yet():
    """The sweep times each program once before serving (`CostModel.startup_reading`). Without
    those readings a load not served yet was predicted from a line through the shapes served:
    after single requests, 8 requests' drafted steps at more than the plain rate, where they ran
    below it (costs as read on the real pair, docs/adaptive.md 2026-12-04)."""
    def served_single_requests() -> AdaptivePolicy:
        policy = AdaptivePolicy(num_drafts=7)
        # Drafts that pass 6 times in 10 at each position, up to the first rejection.
        outcomes = np.cumprod(np.random.default_rng(0).random((400, 7)) < 0.6, axis=1).astype(np.float64)
        policy.calibrator.observe(np.zeros(400, np.int64), None, outcomes, np.ones((400, 7), bool))
        for _ in range(3):
            policy.cost.observe((1, 2, 1), 0.027, 0, 0.0, 0.0)
            policy.cost.observe((1, 8, 8), 0.034, 1, 0.0045, 0.0, draft_block=8)
        policy.cost.compiled_verify.update({(8, 8, 1), (8, 16, 2), (8, 32, 4), (8, 64, 8)})
        policy.cost.compiled_draft.update({(8, b) for b in policy.blocks})
        return policy

    guessed, read = served_single_requests(), served_single_requests()
    for shape, seconds in {(8, 8, 1): 0.035, (8, 16, 2): 0.047, (8, 32, 4): 0.066, (8, 64, 8): 0.105}.items():
        read.cost.startup_reading("verify", shape, seconds)
    for block, seconds in zip(read.blocks, (0.0107, 0.0134, 0.0191)):
        read.cost.startup_reading("draft", (8, block), seconds)
    assert guessed.typical_gain(8) > 1.05 and guessed.drafts_may_pay(8)
    assert read.typical_gain(8) < 1.0 and not read.drafts_may_pay(8)
    assert read.cost.verify((8, 16, 2)) == pytest.approx(0.047) and read.cost.draft(8, 2) == pytest.approx(0.0107)
    assert read.cost.steps_here() == guessed.cost.steps_here() and read.cost.age((8, 16, 2)) is None  # no step
    # Startup readings price as ratios: served over startup seconds of the same load's plain step
    # (the sweep's idle machine and shared pages read low), else of every program served.
    read.cost.observe((8, 8, 1), 0.042, 0, 0.0, 0.0)  # 1.2x its startup reading
    assert read.cost.verify((8, 8, 1)) == pytest.approx(0.042)
    assert read.cost.verify((8, 32, 4)) == pytest.approx(1.2 * 0.066) and read.cost.draft(8, 4) == pytest.approx(1.2 * 0.0134)
    read.cost.observe((8, 16, 2), 0.053, 8, 0.0107 * 1.1, 0.0, draft_block=2)  # a served step replaces its reading
    assert read.cost.verify((8, 16, 2)) == pytest.approx(0.053) and read.cost.draft(8, 2) == pytest.approx(0.0107 * 1.1)
    assert read.cost.verify((8, 32, 4)) == pytest.approx(1.2 * 0.066)  # the plain step of its load still scales it
    # A draft's: the median over the programs served (1.2, 0.053 / 0.047 and 1.1).
    assert read.cost.draft(8, 4) == pytest.approx(0.053 / 0.047 * 0.0134)


def test_past_startup_admits_a_load_waits_for_its_plain_step_served():
    """The startup sweep reads verify shapes of more than 2 requests on the scan and the plain step
    before the layer tuner chose: on an AMD host a fresh batch of 32 read drafts paying at 1.14x
    (its plain step read as dear as a 2-row verify) and ran at 0.47x NONE. Past `startup_admits`
    requests, no context until the load's plain step was served; at or below it, startup decides."""
    policy = AdaptivePolicy(3, prior_acceptance=np.array([0.8, 0.75, 0.7]))
    policy.draft_cost = lambda batch, block: 0.0
    policy.shape_cost = by_rows(0.01, fixed=1.0)  # rows nearly free: drafts pay at every load
    assert policy.drafts_may_pay(32) and policy.drafts_may_pay(1)  # (no rule set)
    policy.startup_admits = 2
    assert not policy.drafts_may_pay(32) and not policy.drafts_may_pay(3)
    assert policy.drafts_may_pay(2) and policy.drafts_may_pay(1)
    policy.cost.observe((32, 32, 1), 0.07, 0, 0.0, 0.0)  # the plain step of 32 served once
    assert policy.drafts_may_pay(32) and policy.drafts_may_pay(17)  # (the same bucket)
    assert not policy.drafts_may_pay(8)


def test_admission_prices_without_the_exploration_discount():
    """An exploring step sees shapes not measured lately at 0.7x (so that they get tried); the
    admission of a joining request must not: one admission in 8 fell on such a step."""
    policy = AdaptivePolicy(num_drafts=3, explore_every=8)
    outcomes = np.tile([1.0, 1.0, 0.0], (100, 1))
    policy.calibrator.observe(np.zeros(100, np.int64), None, outcomes, np.ones((100, 3), bool))
    for _ in range(3):
        policy.cost.observe((8, 8, 1), 0.035, 0, 0.0, 0.0)
    policy.cost.compiled_verify.update({(8, 16, 2), (8, 32, 4)})
    policy.cost.compiled_draft.update({(8, 2), (8, 4)})
    policy.cost.startup_reading("verify", (8, 16, 2), 0.070)
    policy.cost.startup_reading("verify", (8, 32, 4), 0.095)
    policy.cost.startup_reading("draft", (8, 2), 0.012)
    policy.cost.startup_reading("draft", (8, 4), 0.015)
    policy.steps = 1
    assert not policy.exploring
    judged = policy.typical_gain(8)
    policy.steps = 8
    assert policy.exploring and policy.shape_cost((8, 32, 4)) < policy.cost.verify((8, 32, 4))  # the discount
    assert policy.typical_gain(8) == pytest.approx(judged) and judged < policy.admit_ratio  # 0.95 (seen: 1.35)
    assert not policy.drafts_may_pay(8) and policy.exploring


def _drafting_policy() -> AdaptivePolicy:
    """4 requests whose drafts usually pass, with costs measured so that drafting is predicted to
    pay (a plain step 0.1 s for 4 tokens; a draft and a verify of one draft each 0.12 s for ~7.6)."""
    policy = AdaptivePolicy(num_drafts=7, explore_every=0)
    for slot in range(4):
        policy.add(slot)
        policy.requests[slot].estimate[:] = 0.9
    for _ in range(3):
        policy.cost.observe((4, 4, 1), 0.1, 0, 0.0, 0.0)
        policy.cost.observe((4, 8, 2), 0.11, 4, 0.01, 0.0, draft_block=2)
    return policy


def test_joining_requests_get_drafter_context_where_its_realized_gain_pays_for_it():
    """Where 256 or more request-steps with drafter context ran at a load (of the last 512; a step
    of 4 requests is 4), what they realized decides admission there: their mean gain per
    request-step (a drafted step's tokens beyond what a plain step yields in its seconds; 0 for a
    plain step) against what context costs (3%)."""
    policy = _drafting_policy()
    for _ in range(63):
        policy.realized.plain(4)
    assert policy.realized.context_gain(4) is None and policy.drafts_may_pay(4)  # the prediction decides
    policy.realized.drafted(4, 6, 0.1, 0.1)  # 6 tokens where a plain step yields 4: +0.5 per request
    assert policy.realized.context_gain(4) == pytest.approx(4 * 0.5 / 256)
    assert not policy.drafts_may_pay(4) and not policy.drafts_may_pay(3)  # 0.8% a step: less than it costs
    for _ in range(15):
        policy.realized.drafted(4, 6, 0.1, 0.1)
    assert policy.realized.context_gain(4) == pytest.approx(16 * 4 * 0.5 / 316) and policy.drafts_may_pay(4)
    policy.realized.drafted(4, 4, 0.2, 0.1)  # a drafted step that took twice a plain step's time: -0.5
    assert policy.realized.context_gain(4) == pytest.approx((32 - 4 * 0.5) / 320)
    for _ in range(128):  # the evidence rolls: the last 512 request-steps, plain ones only now
        policy.realized.plain(4)
    assert policy.realized.loads[4].rows == 512 and policy.realized.context_gain(4) == pytest.approx(0.0, abs=1e-12)
    assert not policy.drafts_may_pay(4) and policy.drafts_may_pay(8)  # 8 requests: never read there
    assert policy.context_lost(4) and not policy.context_lost(8)  # the running requests lose theirs


def test_evidence_that_context_does_not_pay_expires():
    """Requests refused context at a load are never drafted there, so the evidence that refused
    them would never change: after 512 steps there without context it expires, and the
    prediction decides again."""
    policy = _drafting_policy()
    for _ in range(64):
        policy.realized.plain(4)
    assert policy.context_lost(4) and not policy.drafts_may_pay(4)
    for _ in range(511):
        policy.realized.without_context(4)
    assert policy.context_lost(4)
    policy.realized.plain(4)  # a step with context (a request kept to measure) starts the count over
    for _ in range(511):
        policy.realized.without_context(4)
    assert policy.context_lost(4)
    policy.realized.without_context(4)
    assert not policy.context_lost(4) and policy.realized.context_gain(4) is None and policy.drafts_may_pay(4)


def test_a_request_whose_own_steps_with_context_realized_less_than_context_costs_is_spent():
    """Per request, the steps it ran with drafter context: a drafted one gives it its accepted
    drafts less its share of the step's extra time (in plain steps' tokens), an undrafted one 0;
    once 32 were read, a mean below what context costs (3% a step) spends its context."""
    realized = RealizedGains()
    # One request, a drafted step that took 1.5 plain steps and accepted 1 draft: 2 tokens in the
    # time of 1.5 plain ones: (1 + 1) / 1.5 - 1 = +1/3.
    assert realized.request_gains(1, {7: 1}, 0.15, 0.1) == {7: pytest.approx(1 / 3)}
    # Four requests, two drafted (2 and 0 accepted), the step 1.25x a plain one: 6 tokens, worth
    # 6 x 0.8 - 4 = 0.8 over a plain step, split as 2 x 0.8 - 0.4 and 0 - 0.4 (each drafted request
    # bears half of the 4 x 0.2 tokens the step's extra time cost).
    gains = realized.request_gains(4, {1: 2, 2: 0}, 0.125, 0.1)
    assert gains == {1: pytest.approx(1.2), 2: pytest.approx(-0.4)} and sum(gains.values()) == pytest.approx(0.8)
    for step in range(31):
        realized.request_step({7: 0.0, 8: 0.0 if step % 8 else 1.0})
    assert not realized.spent(7, 0.03) and not realized.spent(8, 0.03)  # 31 steps: too few to judge
    realized.request_step({7: 0.0, 8: 0.0})
    assert realized.spent(7, 0.03)  # 32 plain steps with context: it paid context for nothing
    assert not realized.spent(8, 0.03)  # 4 drafted steps of +1 token in 32: 12.5% a step
    realized.forget(7)
    assert not realized.spent(7, 0.03) and 7 not in realized.requests  # the slot's next request starts over
