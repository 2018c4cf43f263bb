"""The adaptive worker's startup sweep (speculative/precompile.py): it covers every shape the
policy can choose, and afterwards serving in the first context bucket compiles nothing."""

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest

from jax_backend import compiled_memory
from jax_backend.batch import bucket
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.speculative.cost_model import CostModel, step_shape
from sgl_dflash.speculative import adaptive_worker, precompile
from sgl_dflash.speculative.precompile import _lens_for, verify_shapes
from tests.speculative.test_adaptive import random_lengths


def test_verify_shapes_are_every_shape_a_batch_can_take():
    rng = np.random.default_rng(0)
    for max_requests, block in ((32, 8), (5, 16), (1, 4)):
        shapes = verify_shapes(max_requests, block)
        seen = set()
        for _ in range(20000):
            n = int(rng.integers(1, max_requests + 1))
            lens = np.where(rng.random(n) < rng.random(), rng.integers(1, block + 1, n), 1)
            seen.add(step_shape(lens))
        assert seen <= set(shapes)
        for shape in shapes:  # ... and each one a batch the engine can really run
            lens = _lens_for(*shape, block)
            assert step_shape(lens) == shape and len(lens) <= max_requests and lens.max() <= block


def test_the_sweep_reads_the_median_of_three_runs_and_none_that_compiled(monkeypatch):
    cost = CostModel()
    compiles = []
    worker = SimpleNamespace(compilations=lambda: len(compiles), policy=SimpleNamespace(cost=cost))
    clock = iter([0.0, 0.02, 1.0, 1.09, 2.0, 2.03])  # runs of 20, 90 (another process's burst), 30 ms
    monkeypatch.setattr(precompile, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    precompile._time(worker, "verify", (8, 8, 1), lambda: np.zeros(2))
    assert cost.startup == {("verify", (8, 8, 1)): pytest.approx(0.03)}
    monkeypatch.setattr(precompile, "time", time)
    precompile._time(worker, "verify", (8, 16, 2), lambda: compiles.append(1) or np.zeros(2))
    precompile._time(worker, "draft", (8, 2), lambda: np.zeros(2))
    assert set(cost.startup) == {("verify", (8, 8, 1)), ("draft", (8, 2))}
    assert not cost.verify_s and not cost.draft_s  # no measurement of serving


def _a_fresh_process_room() -> int | None:
    """The room of a process that compiled nothing yet under this machine's limit
    (`compiled_memory.program_room`), for the tests of what the sweep covers: in a long test
    session the programs of earlier tests fill the process's mappings, and the sweep would
    rightly leave its context out (tested below)."""
    limit = compiled_memory.map_limit()
    return None if limit is None else limit // compiled_memory.MAPS_PER_PROGRAM


def test_a_precompiled_adaptive_engine_compiles_no_decode_step(engine_kwargs, trained_draft_dir, spec_prompts,
                                                               none_engine, monkeypatch):
    monkeypatch.setattr(compiled_memory, "program_room", _a_fresh_process_room)
    engine = Engine(**{**engine_kwargs, "max_running_requests": 4}, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=trained_draft_dir, speculative_num_draft_tokens=4,
                    speculative_adaptive=True, disable_precompile=False)
    worker = engine.scheduler.worker
    policy = worker.policy
    width = worker.runner.context_pages([192])
    assert policy.cost._compiled_verify.keys() == {width}
    assert policy.cost._compiled_verify[width] == set(verify_shapes(4, 4))
    for window in (128, 256):  # the drafter's windows inside the target's first context bucket
        assert policy.cost.drafts_compiled_at(window) == {(rows, b) for rows in (1, 2, 4) for b in policy.blocks}
    # Each program was timed once: loads not served yet are predicted from their own readings.
    # (A verify shape is left out only where its timed run compiled: the layer-loop tuner's pick.)
    read = {name: {key for n, key in policy.cost.startup if n == name} for name in ("verify", "draft")}
    assert read["draft"] == {(rows, b) for rows in (1, 2, 4) for b in policy.blocks}
    assert {step_shape(np.ones(n, np.int64)) for n in (1, 2, 4)} <= read["verify"] <= set(verify_shapes(4, 4))
    assert len(read["verify"]) >= len(verify_shapes(4, 4)) // 2

    # Random plans and lengths hit many ragged shapes, draft blocks and batch sizes.
    chosen, blocks = random_lengths(engine, monkeypatch, seed=3)
    compiled_steps = []
    decode = worker.forward_decode

    def watched(batch):
        before = worker.compilations()
        out = decode(batch)
        if worker.compilations() != before:
            compiled_steps.append(len(batch.slots))
        return out

    monkeypatch.setattr(worker, "forward_decode", watched)
    prompts, params = spec_prompts * 2, {"temperature": 0.0, "max_new_tokens": 24}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    # The sweep's dummy sequences left nothing behind: greedy output is the target's own.
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in none_engine.generate(input_ids=prompts, sampling_params=params)]
    assert set(blocks) == {0, *policy.blocks} and max(chosen) == 3  # the plans did vary
    assert compiled_steps == []
    # Requests without drafter context (where drafts do not pay, or once their own did not) run
    # NONE's program: compiled too.
    monkeypatch.setattr(policy, "drafts_may_pay", lambda n: False)
    monkeypatch.setattr(adaptive_worker, "MEASURED_EVERY", 1 << 30)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert not worker.drafting and not any(o["meta_info"]["spec_num_proposed_drafts"] for o in outs)
    assert compiled_steps == []


def test_the_cost_model_knows_what_is_compiled_past_the_first_context_bucket(engine_kwargs, trained_draft_dir,
                                                                            monkeypatch):
    """A verify shape compiles per page-table width and a draft per drafter window: after the
    sweep, a step the cost model takes as compiled never compiles, also once contexts grow past
    the swept bucket (where the same shapes compile again and the policy must know it)."""
    monkeypatch.setattr(precompile, "SWEPT_CONTEXTS", (192,))  # the second bucket (512 tokens) not swept
    monkeypatch.setattr(compiled_memory, "program_room", _a_fresh_process_room)
    kwargs = {**engine_kwargs, "max_running_requests": 4, "context_length": 512}
    engine = Engine(**kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_draft_dir,
                    speculative_num_draft_tokens=4, speculative_adaptive=True, disable_precompile=False)
    cost = engine.scheduler.worker.policy.cost
    engine.scheduler.worker.policy.startup_admits = None  # three requests get context from the start
    random_lengths(engine, monkeypatch, seed=5)
    steps = []  # (width, the step's programs were taken as compiled, the step compiled)

    def known(shape, draft_batch, block):
        return shape in cost.compiled_verify and (not draft_batch or (bucket(draft_batch), block) in cost.compiled_draft)

    observe, compiled = cost.observe, cost.compiled

    def observed(shape, verify_s, draft_batch, draft_s, overhead_s, draft_block=0):
        steps.append((cost.width, known(shape, draft_batch, draft_block), False))
        observe(shape, verify_s, draft_batch, draft_s, overhead_s, draft_block=draft_block)

    def compiling(shape, draft_batch, draft_block, seconds):
        steps.append((cost.width, known(shape, draft_batch, draft_block), True))
        compiled(shape, draft_batch, draft_block, seconds)

    monkeypatch.setattr(cost, "observe", observed)
    monkeypatch.setattr(cost, "compiled", compiling)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 16, size=n).tolist() for n in (230, 12, 250)]
    params = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [
        o["output_ids"] for o in Engine(**kwargs).generate(input_ids=prompts, sampling_params=params)]
    widths = {width for width, _, _ in steps}
    assert len(widths) == 2  # the contexts crossed into the second bucket
    assert [s for s in steps if s[1] and s[2]] == []  # nothing taken as compiled compiled
    assert [s for s in steps if s[0] == max(widths) and s[2]]  # past the sweep, steps do compile


def test_sweep_and_policy_keep_within_the_room_for_programs(engine_kwargs, trained_draft_dir, spec_prompts,
                                                            none_engine, monkeypatch, caplog):
    """Near vm.max_map_count a compile kills the process (jax_backend.compiled_memory): the sweep
    leaves out the contexts that do not fit with room to serve, and the policy stops compiling
    drafted programs, saying so; the engine keeps serving exactly."""
    engine = Engine(**{**engine_kwargs, "max_running_requests": 4}, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=trained_draft_dir, speculative_num_draft_tokens=4,
                    speculative_adaptive=True)
    worker = engine.scheduler.worker
    free_pages = worker.allocator.num_free_pages
    monkeypatch.setattr(compiled_memory, "program_room", lambda: precompile.SERVING_PROGRAMS + 1)
    with caplog.at_level(logging.WARNING):
        precompile.sweep(worker, contexts=[192], progress=False)
        assert worker.policy.may_compile
        worker._check_program_room()
        assert worker.policy.may_compile  # room past the serving reserve: drafted programs may compile
        monkeypatch.setattr(compiled_memory, "program_room", lambda: precompile.SERVING_PROGRAMS)
        worker._check_program_room()
    assert "precompiling 0 of 1 contexts" in caplog.text and "raise vm.max_map_count" in caplog.text
    assert not any(worker.policy.cost._compiled_verify.values()) and worker.allocator.num_free_pages == free_pages
    assert not worker.policy.may_compile
    params = {"temperature": 0.0, "max_new_tokens": 16}
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in none_engine.generate(input_ids=spec_prompts, sampling_params=params)]
    assert all(shape[2] == 1 for shapes in worker.policy.cost._compiled_verify.values() for shape in shapes)  # no draft
