"""The adaptive worker's startup sweep (speculative/precompile.py): it covers every shape the
policy can choose, and afterwards serving in the first context bucket compiles nothing."""

import numpy as np

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.speculative.cost_model import step_shape
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


def test_a_precompiled_adaptive_engine_compiles_no_decode_step(engine_kwargs, trained_draft_dir, spec_prompts,
                                                               none_engine, monkeypatch):
    engine = Engine(**{**engine_kwargs, "max_running_requests": 4}, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=trained_draft_dir, speculative_num_draft_tokens=4,
                    speculative_adaptive=True, disable_precompile=False)
    worker = engine.scheduler.worker
    policy = worker.policy
    assert policy.cost.compiled_verify == set(verify_shapes(4, 4))
    assert policy.cost.compiled_draft == {(rows, b) for rows in (1, 2, 4) for b in policy.blocks}

    # Random plans and lengths hit many ragged shapes, draft blocks and batch sizes.
    chosen, blocks = random_lengths(engine, monkeypatch, seed=3)
    compiled_steps = []
    decode = worker.forward_decode

    def watched(batch):
        before = worker._compilations()
        out = decode(batch)
        if worker._compilations() != before:
            compiled_steps.append(len(batch.slots))
        return out

    monkeypatch.setattr(worker, "forward_decode", watched)
    prompts, params = spec_prompts * 2, {"temperature": 0.0, "max_new_tokens": 24}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    # The sweep's dummy sequences left nothing behind: greedy output is the target's own.
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in none_engine.generate(input_ids=prompts, sampling_params=params)]
    assert set(blocks) == {0, *policy.blocks} and max(chosen) == 3  # the plans did vary
    assert compiled_steps == []
