"""--speculative-adaptive end to end: greedy output equals NONE's whatever lengths are chosen (the
policy's own, and random ones that hit every ragged shape), the drafter stays in lockstep with the
target, sampling stays lossless, and the chosen lengths are reported."""

import dataclasses

import jax
import numpy as np
import pytest

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.errors import ServerArgsError
from sgl_dflash.speculative import adaptive_worker
from sgl_dflash.speculative.adaptive import DraftPlan
from sgl_dflash.speculative.realized import RealizedGains
from tests.speculative.test_dflash import batch_requests, reference_params, watch_steps
from tests.speculative.test_dflash_sampling import exact_joint, goodness_of_fit


@pytest.fixture(scope="module")
def adaptive_engine(engine_kwargs, trained_draft_dir):
    engine = Engine(**engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_draft_dir,
                    speculative_adaptive=True)
    # Every request gets drafter context: these tests exercise drafting whatever this machine's
    # costs say (`test_requests_join_without_drafter_context_where_drafts_do_not_pay` tests the rule).
    engine.scheduler.worker.policy.admit_ratio = 0.0
    engine.scheduler.worker.policy.realized = never_enough()
    return engine


def never_enough() -> RealizedGains:
    """Realized gains never read often enough to decide: admission goes by the prediction and no
    request loses its context (what this CPU's steps realize would decide otherwise;
    `test_steps_with_context_are_read_as_realized_gains` and test_adaptive_policy.py test them)."""
    return RealizedGains(min_gain_rows=1 << 30, min_request_steps=1 << 30)


def random_lengths(engine, monkeypatch, seed=0, plain_steps=None):
    """Replace the policy's decisions by random ones (drafted or not, any draft block, any k):
    every mix of ragged blocks, shorter draft blocks, plain steps and pending drafter rows.
    Returns the chosen k and draft blocks (0: nothing drafted); `plain_steps` (a list) gets
    whether each step verifies no draft."""
    plain_steps = [] if plain_steps is None else plain_steps
    rng = np.random.default_rng(seed)
    policy = engine.scheduler.worker.policy
    monkeypatch.setattr(policy, "admit_ratio", 0.0)  # every request gets drafter context
    monkeypatch.setattr(policy, "realized", never_enough())
    chosen, blocks = [], []

    def plan(slots, draftable):
        drafted = (rng.random(len(slots)) < 0.6) & draftable
        block = int(rng.choice(policy.blocks)) if drafted.any() else 0
        blocks.append(block)
        plain_steps.append(not drafted.any())
        return DraftPlan(drafted, block)

    def choose(slots, modes, drafted, confidence, seconds, block):
        k = np.where(drafted, rng.integers(0, block, len(slots)), 0)
        chosen.extend(k.tolist())
        plain_steps[-1] = not k.any()
        return k

    monkeypatch.setattr(policy, "plan_drafts", plan)
    monkeypatch.setattr(policy, "choose", choose)
    return chosen, blocks


def flat_costs(engine, monkeypatch):
    """Costs of an accelerator (a verify step costs the same at any length, drafting is free), in
    place of the measured ones: the policy's decisions no longer depend on this machine's timing,
    and speculating pays, so a test's speculative path is exercised on any machine."""
    policy = engine.scheduler.worker.policy
    monkeypatch.setattr(policy, "shape_cost", lambda shape: 1.0)
    monkeypatch.setattr(policy.cost, "draft", lambda batch, block: 0.0)
    monkeypatch.setattr(policy, "realized", never_enough())  # nor what this CPU's steps realize


@pytest.fixture(scope="module")
def none_outputs(none_engine, spec_prompts):
    base = [o["output_ids"] for o in none_engine.generate(input_ids=spec_prompts, sampling_params=reference_params(spec_prompts))]
    params = batch_requests(base)
    outs = none_engine.generate(input_ids=spec_prompts, sampling_params=params)
    return params, [o["output_ids"] for o in outs]


def greedy_equals_none(engine, none_engine, seed: int, count: int, max_new_tokens: int) -> list[dict]:
    """`count` random prompts (2-29 tokens) in one generate call: greedy output equals NONE's."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 16, int(n)).tolist() for n in rng.integers(2, 30, count)]
    greedy = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=greedy)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in none_engine.generate(
        input_ids=prompts, sampling_params=greedy)]
    return outs


@pytest.mark.parametrize("lengths", ["policy", "random"])
def test_adaptive_greedy_equals_none(lengths, adaptive_engine, none_engine, spec_prompts, none_outputs, monkeypatch):
    plain = []
    chosen, blocks = random_lengths(adaptive_engine, monkeypatch, plain_steps=plain) if lengths == "random" else (None, None)
    log = watch_steps(adaptive_engine, monkeypatch)
    runner, programs = adaptive_engine.scheduler.worker.runner, {"sample": 0, "verify": 0}
    for name in programs:  # which target program each decode step ran
        monkeypatch.setattr(runner, name, _counting(getattr(runner, name), programs, name))
    params, expected = none_outputs
    outs = adaptive_engine.generate(input_ids=spec_prompts, sampling_params=params)  # stop rules cut blocks
    assert [o["output_ids"] for o in outs] == expected
    single = adaptive_engine.generate(input_ids=spec_prompts[2], sampling_params=params[2])
    assert single["output_ids"] == expected[2]
    outs = greedy_equals_none(adaptive_engine, none_engine, seed=5, count=24, max_new_tokens=33)
    assert log["checks"] > 0
    if chosen is not None:  # every k and every draft block the drafter offers (16: 2, 4, 8, 16) ran
        assert set(chosen) == set(range(adaptive_engine.scheduler.worker.block_size))
        assert set(blocks) - {0} == {2, 4, 8, 16}
        # A step that verifies no draft (nothing drafted, or every k = 0) runs NONE's sampling
        # program; the others one verify.
        assert 0 < sum(plain) < len(plain)
        assert programs == {"sample": sum(plain), "verify": len(plain) - sum(plain)}
    for out in outs:
        info = out["meta_info"]
        lens = info["spec_verify_len_histogram"]
        assert sum(lens) == info["spec_verify_ct"] == sum(info["spec_correct_drafts_histogram"])
        assert info["spec_num_proposed_drafts"] == sum(k * c for k, c in enumerate(lens))
        assert info["spec_mean_verify_len"] == pytest.approx(info["spec_num_proposed_drafts"] / info["spec_verify_ct"])
        assert info["spec_no_spec_fraction"] == pytest.approx(lens[0] / info["spec_verify_ct"])


def test_requests_join_without_drafter_context_where_drafts_do_not_pay(adaptive_engine, none_engine, monkeypatch):
    """Where drafts may not pay at the load a request joins (`AdaptivePolicy.drafts_may_pay`), it
    gets no drafter context and runs NONE's steps, exactly; every `MEASURED_EVERY`-th gets context
    anyway (and is drafted, ragged beside the others). Nothing is left behind when they finish."""
    worker = adaptive_engine.scheduler.worker
    loads = []
    monkeypatch.setattr(worker.policy, "drafts_may_pay", lambda n: loads.append(n) or False)
    monkeypatch.setattr(worker, "admitted", 0)
    monkeypatch.setattr(adaptive_worker, "MEASURED_EVERY", 16)
    flat_costs(adaptive_engine, monkeypatch)  # the one with context drafts whenever it gains
    monkeypatch.setattr(worker.policy, "min_gain", 0.0)  # (beside 19 plain requests: a gain of ~1 in 20)
    added, programs = {"add": 0}, {"sample": 0, "verify": 0}
    monkeypatch.setattr(worker.proposer, "add", _counting(worker.proposer.add, added, "add"))
    for name in programs:
        monkeypatch.setattr(worker.runner, name, _counting(getattr(worker.runner, name), programs, name))
    features = []  # what NONE's steps (waited for) asked of `sample`: no request reads features there

    def sample(*args, sample=worker.runner.sample, **kwargs):
        if kwargs.get("wait", True):
            features.append(kwargs.get("features", True))
        return sample(*args, **kwargs)

    monkeypatch.setattr(worker.runner, "sample", sample)
    log = watch_steps(adaptive_engine, monkeypatch)
    outs = greedy_equals_none(adaptive_engine, none_engine, seed=7, count=20, max_new_tokens=40)
    assert features and not any(features)
    assert added["add"] == 1 and log["checks"] > 0  # the 16th of 20: its drafter kept in lockstep
    assert loads and min(loads) >= 1  # asked once per prefill, with the load after it
    assert programs["verify"] > 0 and programs["sample"] > 0  # it was drafted; the others ran plain
    assert sum(o["meta_info"]["spec_num_proposed_drafts"] > 0 for o in outs) == 1
    assert not worker.drafting and not worker.policy.requests and not worker.proposer._seqs


def test_steps_without_drafter_context_are_nones_steps_timed_once_in_eight(adaptive_engine, none_engine, monkeypatch):
    """A batch none of whose requests has drafter context runs NONE's decode step with a counter's
    upkeep; only every `PLAIN_READ_EVERY`-th step (the first included) checks for compiles and is
    timed for the cost model (that upkeep on every step cost ~0.3 ms of a ~9.5 ms step at one
    request). Output stays NONE's; a prefill where no request gets context is NONE's too."""
    worker = adaptive_engine.scheduler.worker
    monkeypatch.setattr(worker.policy, "drafts_may_pay", lambda n: False)
    monkeypatch.setattr(adaptive_worker, "MEASURED_EVERY", 1 << 30)
    monkeypatch.setattr(worker, "_none_steps", -1)
    counts = {"observe": 0, "compiled": 0, "compilations": 0, "decode": 0}
    for name in ("observe", "compiled"):
        monkeypatch.setattr(worker.policy.cost, name, _counting(getattr(worker.policy.cost, name), counts, name))
    monkeypatch.setattr(worker, "compilations", _counting(worker.compilations, counts, "compilations"))
    target = worker.target_worker
    monkeypatch.setattr(target, "forward_decode", _counting(target.forward_decode, counts, "decode"))
    prefills = []  # and their prefill NONE's: no features computed
    forward = worker.runner.forward
    monkeypatch.setattr(worker.runner, "forward", lambda *a, **k: prefills.append(k.get("features", True)) or forward(*a, **k))
    greedy_equals_none(adaptive_engine, none_engine, seed=17, count=3, max_new_tokens=30)
    timed = -(-counts["decode"] // adaptive_worker.PLAIN_READ_EVERY)
    assert counts["decode"] == 29 and not worker.drafting  # every decode step NONE's, no context
    assert prefills and not any(prefills)
    assert counts["observe"] + counts["compiled"] == timed == 4 and counts["compilations"] == 2 * timed


def test_a_plain_steps_host_work_runs_while_the_device_steps(adaptive_engine, none_engine, spec_prompts, monkeypatch):
    """A step that verifies no draft knows its outcome (nothing accepted) before the target's
    step ends: the drafter's commit and the policy's learning are dispatched before its tokens
    are read (read earlier, that host work added ~1 ms to every plain step at one request). Once
    read, the step is reported to the runner, whose layer-loop tuner times it as NONE's steps."""
    worker, events = adaptive_engine.scheduler.worker, []
    monkeypatch.setattr(worker.policy, "plan_drafts", lambda slots, draftable: DraftPlan(np.zeros(len(slots), bool), 0))

    class Tokens:  # the step's device tokens; records when the worker reads them
        def __init__(self, array):
            self.array = array

        def __array__(self, dtype=None, copy=None):
            events.append("read")
            return np.asarray(self.array, dtype)

    def sample(*args, sample=worker.runner.sample, **kwargs):
        out = sample(*args, **kwargs)
        return dataclasses.replace(out, tokens=Tokens(out.tokens)) if kwargs.get("wait") is False else out

    monkeypatch.setattr(worker.runner, "sample", sample)
    for obj, name in ((worker.proposer, "commit_block"), (worker.policy, "observe"), (worker.runner, "step_read")):
        monkeypatch.setattr(obj, name, _logged(getattr(obj, name), events, name))
    timed = []

    def observe(key, loop, seconds, observe=worker.runner._tuner.observe):
        timed.append((key[0], seconds))  # 0.0: the other layer loop's compile at a shape's first step
        observe(key, loop, seconds)

    monkeypatch.setattr(worker.runner._tuner, "observe", observe)
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    out = adaptive_engine.generate(input_ids=spec_prompts[0], sampling_params=params)
    assert out["output_ids"] == none_engine.generate(input_ids=spec_prompts[0], sampling_params=params)["output_ids"]
    steps = [events[i : i + 4] for i in range(0, len(events), 4)]
    assert len(steps) == 5 and all(step == ["commit_block", "observe", "read", "step_read"] for step in steps)
    assert [kind for kind, seconds in timed if seconds > 0] == ["sample"] * 5  # one per plain step


@pytest.mark.parametrize("kind", ["NONE", "adaptive"])
def test_decode_steps_hand_their_host_arrays_to_jit_without_device_put(kind, adaptive_engine, none_engine, spec_prompts,
                                                                       monkeypatch):
    """A decode step's host arrays (the target's batch, the drafter's lengths, slots and bonus
    tokens) go to the jitted programs as numpy, which jit's C++ dispatch copies: `jax.device_put`'s
    Python path took 0.3-0.4 ms of every serving step (docs/performance.md section 16). Random
    lengths run plain steps, ragged verifies, every draft block and the drafter's flushes."""
    engine = adaptive_engine if kind == "adaptive" else none_engine
    if kind == "adaptive":
        random_lengths(engine, monkeypatch, seed=3)
    worker, puts, decoding = engine.scheduler.worker, [], [False]

    def decode(batch, decode=worker.forward_decode):
        decoding[0] = True
        try:
            return decode(batch)
        finally:
            decoding[0] = False

    def device_put(*args, put=jax.device_put, **kwargs):
        puts.append(decoding[0])
        return put(*args, **kwargs)

    monkeypatch.setattr(worker, "forward_decode", decode)
    monkeypatch.setattr(jax, "device_put", device_put)
    steps = engine.scheduler.stats["decode_steps"]
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    assert all(len(o["output_ids"]) == 12 for o in outs)
    assert engine.scheduler.stats["decode_steps"] > steps
    assert not any(puts), f"{sum(puts)} jax.device_put calls inside decode steps"


def _logged(fn, events, name):
    def logged(*args, **kwargs):
        events.append(name)
        return fn(*args, **kwargs)
    return logged


def _counting(fn, counts, name):
    def counted(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)
    return counted


def test_steps_with_context_are_read_as_realized_gains(adaptive_engine, none_engine, monkeypatch):
    """Each measured drafted step reaches the policy's realized gains once, with what it yielded
    and took (the drafter's work it left behind included), and each plain step with context as
    one that gained nothing; the output stays NONE's."""
    worker = adaptive_engine.scheduler.worker
    flat_costs(adaptive_engine, monkeypatch)  # drafts pay: drafted steps happen
    gains = RealizedGains(min_gain_rows=1 << 30, min_request_steps=1 << 30)
    monkeypatch.setattr(worker.policy, "realized", gains)
    drafted, plain, readings = [], [], []
    monkeypatch.setattr(gains, "drafted", lambda *reading: drafted.append(reading) or readings.append(reading[0]))
    monkeypatch.setattr(gains, "plain", lambda n: plain.append(n) or readings.append(n))
    request_step = gains.request_step
    monkeypatch.setattr(gains, "request_step", lambda g: readings.append(dict(g)) or request_step(g))
    greedy_equals_none(adaptive_engine, none_engine, seed=9, count=6, max_new_tokens=40)
    B = worker.block_size
    assert drafted and all(n <= tokens <= n * B and seconds > 0 and plain_s > 0
                           for n, tokens, seconds, plain_s in drafted)
    assert all(1 <= n <= 6 for n in plain)
    # Each reading is followed by its requests' own (every request had context here; those that
    # finished before a drafted step was read are left out), none below -n tokens.
    pairs = list(zip(readings[::2], readings[1::2]))
    assert len(readings) == 2 * len(pairs) and pairs
    assert all(isinstance(n, int) and isinstance(g, dict) and len(g) <= n for n, g in pairs)
    assert sum(len(g) == n for n, g in pairs) >= len(pairs) // 2
    assert all(np.isfinite(gain) and gain >= -n for n, g in pairs for gain in g.values())


def test_requests_lose_drafter_context_where_it_realized_less_than_it_costs(adaptive_engine, none_engine, monkeypatch):
    """Where what steps with context realized at a load is below what context costs
    (`AdaptivePolicy.context_lost`), the running requests go on without it, as NONE serves them,
    exactly; one given context only to keep measuring (`MEASURED_EVERY`) keeps it."""
    worker = adaptive_engine.scheduler.worker
    monkeypatch.setattr(worker.policy, "context_lost", lambda n: True)
    flat_costs(adaptive_engine, monkeypatch)  # with context, drafting would pay
    monkeypatch.setattr(worker.policy, "min_gain", 0.0)
    released = []
    monkeypatch.setattr(worker.proposer, "release", _logged(worker.proposer.release, released, "release"))
    outs = greedy_equals_none(adaptive_engine, none_engine, seed=11, count=6, max_new_tokens=30)
    assert not any(o["meta_info"]["spec_num_proposed_drafts"] for o in outs)  # all six lost it at once
    assert len(released) == 6 and not worker.drafting and not worker.proposer._seqs

    released.clear()
    monkeypatch.setattr(worker.policy, "drafts_may_pay", lambda n: False)
    monkeypatch.setattr(worker, "admitted", 0)
    monkeypatch.setattr(adaptive_worker, "MEASURED_EVERY", 4)
    outs = greedy_equals_none(adaptive_engine, none_engine, seed=12, count=6, max_new_tokens=30)
    assert sum(o["meta_info"]["spec_num_proposed_drafts"] > 0 for o in outs) == 1  # the 4th, measuring
    assert len(released) == 1 and not worker.drafting and not worker.measuring and not worker.proposer._seqs


def test_a_request_whose_own_steps_with_context_gained_nothing_goes_on_without_it(adaptive_engine, none_engine,
                                                                                  monkeypatch):
    """A request whose own steps with drafter context realized less than context costs
    (`RealizedGains.spent`: here 8 plain steps with context, which gain nothing) goes on as NONE
    serves it, exactly: its drafter state is freed mid-answer and its later steps are NONE's."""
    worker = adaptive_engine.scheduler.worker
    monkeypatch.setattr(worker.policy, "realized", RealizedGains(min_gain_rows=1 << 30, min_request_steps=8))
    monkeypatch.setattr(worker.policy, "plan_drafts", lambda slots, draftable: DraftPlan(np.zeros(len(slots), bool), 0))
    released, kinds = [], []
    monkeypatch.setattr(worker.proposer, "release", _logged(worker.proposer.release, released, "release"))
    monkeypatch.setattr(worker, "_none_step", _logged(worker._none_step, kinds, "none"))
    monkeypatch.setattr(worker, "_plain_step", _logged(worker._plain_step, kinds, "with context"))
    outs = greedy_equals_none(adaptive_engine, none_engine, seed=13, count=4, max_new_tokens=30)
    assert len(released) == 4 and not worker.drafting and not worker.policy.realized.requests
    first_none = kinds.index("none")
    assert 8 <= first_none < 20 and set(kinds[first_none:]) == {"none"}  # all four spent after 8 measured steps
    assert not any(o["meta_info"]["spec_num_proposed_drafts"] for o in outs)


def test_policy_uses_a_good_drafter_and_reports_it(adaptive_engine, spec_prompts, monkeypatch):
    # Whether drafting pays for the tiny pair depends on this machine's timing of the moment
    # (it failed under a loaded lane); with an accelerator's costs it pays, so a policy that
    # reads its good drafter's confidence must draft and get drafts right.
    flat_costs(adaptive_engine, monkeypatch)
    params = reference_params(spec_prompts * 4)
    adaptive_engine.generate(input_ids=spec_prompts * 4, sampling_params=params)  # learn costs
    outs = adaptive_engine.generate(input_ids=spec_prompts * 4, sampling_params=params)
    correct = sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs)
    assert correct > 0
    stats = adaptive_engine.scheduler.get_stats()
    assert 0 <= stats["spec_no_spec_fraction"] <= 1 and stats["spec_mean_verify_len"] > 0
    policy = adaptive_engine.scheduler.worker.policy
    assert policy.cost.verify_s and policy.cost.draft_s  # measured, compiles excluded
    assert not policy.requests  # released with their requests


def test_block_flag_is_an_upper_bound(engine_kwargs, trained_draft_dir, caplog):
    """The drafter drafts 16: adaptive clips a larger bound (and says so); fixed mode refuses it."""
    common = dict(engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_draft_dir)
    with pytest.raises(ServerArgsError, match=r"\[2, 16\]"):
        Engine(**common, speculative_num_draft_tokens=32)
    engine = Engine(**common, speculative_num_draft_tokens=32, speculative_adaptive=True)
    assert engine.scheduler.worker.block_size == 16 and engine.server_args.speculative_num_draft_tokens == 16
    assert "verifies at most 15 drafts" in caplog.text
    small = Engine(**common, speculative_num_draft_tokens=4, speculative_adaptive=True)
    assert small.scheduler.worker.block_size == 4
    with pytest.raises(ServerArgsError, match="NONE"):
        Engine(**engine_kwargs, speculative_adaptive=True)


def test_cli_flag():
    import argparse

    from sgl_dflash.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", "--speculative-adaptive"]))
    assert args.speculative_adaptive is True
    assert ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m"])).speculative_adaptive is False


NUM_SAMPLES = 2048


@pytest.mark.slow
@pytest.mark.parametrize("lengths, config", [("random", {"temperature": 1.0}),
                                             ("policy", {"temperature": 0.8, "top_k": 3})])
def test_adaptive_sampling_matches_target_distribution(lengths, config, adaptive_engine, spec_target_dir, spec_prompts,
                                                       monkeypatch):
    """Rejection sampling over whatever length was chosen: the first 3 tokens' joint distribution
    equals target-only sampling (chi-square, as tests/speculative/test_dflash_sampling.py)."""
    from tests.tiny_checkpoints import load_hf_model

    if lengths == "random":
        random_lengths(adaptive_engine, monkeypatch, seed=1)
    else:  # the policy's own lengths, from costs that do not depend on the machine's timing
        flat_costs(adaptive_engine, monkeypatch)
    prompt = spec_prompts[1]
    joint = exact_joint(load_hf_model(spec_target_dir), prompt, **config)
    outs = adaptive_engine.generate(input_ids=[prompt] * NUM_SAMPLES,
                                    sampling_params={**config, "max_new_tokens": 3, "ignore_eos": True})
    samples = np.array([o["output_ids"] for o in outs])
    p_value, impossible = goodness_of_fit(samples, joint)
    assert impossible == 0
    assert p_value > 1e-3, p_value
    hist = np.sum([o["meta_info"]["spec_correct_drafts_histogram"][:3] for o in outs], axis=0)
    assert hist[0] > 0 and hist[1:].sum() > NUM_SAMPLES // 50, hist  # drafts accepted and rejected


def test_admission_is_priced_at_the_joining_requests_context_with_the_drafters_prior(adaptive_engine, monkeypatch):
    """A joining request's admission reads the cost model at the context it decodes at (what is
    compiled there, not wherever the last step left it). Before evidence the drafter's recorded
    acceptance prices it (`DFlashConfig.prior_acceptance`: on unseen prompts, else held-out), where
    its config.json records one (this drafter, trained without a held-out split, has none: the rule
    is yes until evidence, tests/speculative/test_adaptive_policy.py; the shipped one's record:
    tests/torchax_proposer/test_held_out_acceptance.py)."""
    worker = adaptive_engine.scheduler.worker
    assert worker.proposer.config.prior_acceptance(worker.block_size) is None
    assert worker.policy.prior_acceptance is None
    cost, priced = worker.policy.cost, []
    monkeypatch.setattr(worker.policy, "drafts_may_pay", lambda n: priced.append((cost.width, cost.draft_window)) or True)
    for length in (5, 150):
        cost.at(0, 0)
        adaptive_engine.generate(input_ids=[[3 + i % 13 for i in range(length)]],
                                 sampling_params={"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True})
        assert priced[-1] == (worker.runner.context_pages([length]), worker.proposer.window(length))
    assert priced[0] != priced[1]  # two contexts, two sets of programs
