"""Scheduler: continuous batching under a KV page budget smaller than the load (queueing and
retraction, outputs unchanged, pages back to baseline), abort, failing requests isolated, and no
compilation in steady-state decoding."""

import jax
import numpy as np
import pytest

from sgl_dflash.errors import InvalidRequestError
from sgl_dflash.sampling_params import SamplingParams
from sgl_dflash.managers.schedule_batch import Req
from sgl_dflash.model_executor.forward_batch_info import ForwardMode


def run_to_completion(scheduler, reqs, on_step=None):
    for req in reqs:
        scheduler.add_request(req)
    while scheduler.has_work():
        progressed = scheduler.step()
        if on_step is not None:
            on_step(progressed)
    return reqs


def greedy(max_new_tokens, **extra):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **extra)


@pytest.fixture(params=["NONE", "DFLASH"])
def engine(request, none_engine, dflash_engine):
    return none_engine if request.param == "NONE" else dflash_engine(4)


NEW_TOKENS = 150


@pytest.fixture(scope="module")
def heavy_load(none_engine):
    """32 prompts whose KV needs exceed the pool (about 1.6x), and their greedy outputs computed 8
    at a time (which fits); greedy DFLASH must produce the same (lossless)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 16, size=int(rng.integers(60, 100))).tolist() for _ in range(32)]
    expected = []
    for group in range(0, 32, 8):
        outs = none_engine.generate(input_ids=prompts[group : group + 8], sampling_params={
            "temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
        expected += [o["output_ids"] for o in outs]
    return prompts, expected


@pytest.mark.slow
def test_page_budget_smaller_than_load(engine, heavy_load):
    """All requests finish with the outputs they get with enough memory; pages come back."""
    scheduler = engine.scheduler
    prompts, expected = heavy_load
    need = sum(-(-(len(p) + NEW_TOKENS + scheduler.worker.tokens_per_step) // 16) for p in prompts)
    assert need > scheduler.total_pages  # the load does not fit at once
    retractions_before = scheduler.get_stats()["num_retractions"]
    seen = {"waiting_after_retraction": False}

    def on_step(progressed):
        stats = scheduler.get_stats()
        if stats["num_retractions"] > retractions_before and stats["num_waiting"] and stats["num_running"]:
            seen["waiting_after_retraction"] = True

    reqs = [Req(f"budget-{i}", p, greedy(NEW_TOKENS)) for i, p in enumerate(prompts)]
    run_to_completion(scheduler, reqs, on_step)
    assert [r.output_ids for r in reqs] == expected
    assert all(r.finished_reason == {"type": "length", "length": NEW_TOKENS} for r in reqs)
    assert scheduler.get_stats()["num_retractions"] > retractions_before
    assert any(r.num_retractions for r in reqs)
    assert seen["waiting_after_retraction"]
    stats = scheduler.get_stats()
    assert stats["num_free_pages"] == stats["total_pages"]  # every page came back
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_abort_frees_pages_at_once(engine, spec_prompts):
    scheduler = engine.scheduler
    expected = [o["output_ids"] for o in engine.generate(input_ids=spec_prompts, sampling_params={
        "temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True})]
    reqs = [Req(f"abort-{i}", p, greedy(30)) for i, p in enumerate(spec_prompts)]
    for req in reqs:
        scheduler.add_request(req)
    scheduler.step()  # prefill
    scheduler.step()  # one decode step
    victim = reqs[3]
    assert victim in scheduler.running and victim.slot is not None
    pages = len(scheduler.allocator.page_table(victim.slot))
    free_before = scheduler.allocator.num_free_pages
    assert scheduler.abort_request(victim.rid)
    assert scheduler.allocator.num_free_pages == free_before + pages
    assert victim.finished_reason["type"] == "abort"
    assert not scheduler.abort_request(victim.rid)  # already gone
    assert not scheduler.abort_request("no-such-request")
    waiting = Req("abort-waiting", spec_prompts[0], greedy(5))
    scheduler.waiting.append(waiting)
    assert scheduler.abort_request(waiting.rid) and waiting.finished
    progressed = scheduler.step()
    assert victim in progressed and waiting in progressed  # reported once, on the next step
    while scheduler.has_work():
        scheduler.step()
    assert [r.output_ids for r in reqs[:3]] == expected[:3]
    assert expected[3][: len(victim.output_ids)] == victim.output_ids
    stats = scheduler.get_stats()
    assert stats["num_free_pages"] == stats["total_pages"]


def test_failing_request_does_not_disturb_others(engine, spec_prompts, monkeypatch):
    scheduler = engine.scheduler
    expected = [o["output_ids"] for o in engine.generate(input_ids=spec_prompts, sampling_params={
        "temperature": 0.0, "max_new_tokens": 30, "ignore_eos": True})]
    reqs = [Req(f"fail-{i}", p, greedy(30)) for i, p in enumerate(spec_prompts)]
    poison = reqs[2]
    target = scheduler.worker.runner

    def failing(step):
        def run(seqs, *args, **kwargs):
            # The target fails on any batch holding the poisoned request, after its 5th token.
            pages = scheduler.allocator.page_table(poison.slot) if poison.slot is not None else []
            if len(poison.output_ids) >= 5 and any(list(s.page_table[:1]) == pages[:1] for s in seqs):
                raise RuntimeError("injected device failure")
            return step(seqs, *args, **kwargs)

        return run

    for entry_point in ("forward", "sample", "verify"):  # every jitted step of the target
        monkeypatch.setattr(target, entry_point, failing(getattr(target, entry_point)))
    for req in reqs:
        scheduler.add_request(req)
    # A request refused at the door does not disturb the running ones either.
    with pytest.raises(InvalidRequestError):
        scheduler.add_request(Req("bad", [1, 2, 99], greedy(5)))
    while scheduler.has_work():
        scheduler.step()
    assert poison.finished_reason["type"] == "abort"
    assert "injected device failure" in poison.finished_reason["message"]
    assert poison.output_ids == expected[2][: len(poison.output_ids)]
    assert [r.output_ids for i, r in enumerate(reqs) if i != 2] == [e for i, e in enumerate(expected) if i != 2]
    stats = scheduler.get_stats()
    assert stats["num_free_pages"] == stats["total_pages"]


def test_steady_state_decode_compiles_nothing(engine, monkeypatch):
    """Once every bucket shape has been seen, decoding new requests compiles no program."""
    compiles = []

    def on_duration(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    def on_event(name, *args, **kwargs):
        if name == "/jax/compilation_cache/compile_requests_use_cache":  # persistent-cache lookups
            compiles.append(name)

    worker = engine.scheduler.worker
    run = worker.forward_batch_generation
    in_decode = []

    def counting_run(batch):
        before = len(compiles)
        result = run(batch)
        if batch.forward_mode is ForwardMode.DECODE:
            in_decode.append(len(compiles) - before)
        return result

    monkeypatch.setattr(worker, "forward_batch_generation", counting_run)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        lengths = [3, 7, 12, 21]
        params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in (12, 20, 28, 44)]
        rng = np.random.default_rng(11)
        # Warm up until every accept length (a commit shape) has been seen, at most a few rounds.
        hist = None
        for _ in range(6):
            warmup = engine.generate(input_ids=[rng.integers(0, 16, size=n).tolist() for n in lengths],
                                     sampling_params=params)
            if "spec_correct_drafts_histogram" not in warmup[0]["meta_info"]:
                break
            seen = np.sum([o["meta_info"]["spec_correct_drafts_histogram"] for o in warmup], axis=0)
            hist = seen if hist is None else hist + seen
            if np.all(hist > 0):
                break
        assert hist is None or np.all(hist > 0), hist
        in_decode.clear()
        engine.generate(input_ids=[rng.integers(0, 16, size=n).tolist() for n in lengths], sampling_params=params)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)
    assert len(in_decode) > 10 and sum(in_decode) == 0, in_decode
