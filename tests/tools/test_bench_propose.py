"""sgl_dflash.tools.bench_propose on a tiny DFLASH engine: its worker's own proposer is timed per
draft block, warm and after a target step, the engine's state is left as it was, and the JSON
fields and plot are written."""

from __future__ import annotations

import json

import jax

import numpy as np
import pytest

from torchax_proposer import DrafterStateError

from sgl_dflash.tools import bench_propose as bp


def test_propose_times_per_block_and_the_engine_left_clean(dflash_engine, spec_prompts):
    engine = dflash_engine(4)
    worker = engine.scheduler.worker
    free_pages = worker.runner.allocator.num_free_pages
    rows = bp.measure(engine, [2, 4], context=24, repeats=3)
    assert [r["block"] for r in rows] == [2, 4]
    assert all(r["warm_ms"] > 0 and r["after_target_step_ms"] > 0 for r in rows)
    # The bench's sequence is gone from the drafter and the KV pool: the engine serves on unchanged.
    assert worker.runner.allocator.num_free_pages == free_pages
    with pytest.raises(DrafterStateError):
        worker.proposer.committed_len("bench_propose")
    out = engine.generate(input_ids=[spec_prompts[0]], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert len(out[0]["output_ids"]) == 4
    nbytes = bp.drafter_bytes(worker.proposer)
    assert nbytes >= sum(leaf.nbytes for leaf in jax.tree.leaves(worker.proposer.narrow_params))


def test_plot_and_goal_line(tmp_path):
    result = {"rows": [{"block": 4, "warm_ms": 1.7, "after_target_step_ms": 2.3},
                       {"block": 8, "warm_ms": 1.8, "after_target_step_ms": 2.7}],
              "floor_ms": 0.94, "context": 120}
    png = bp.plot(result, tmp_path / "propose.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(result))["rows"][1]["block"] == 8 and bp.GOAL_MS == 2.0
    calls = []
    assert bp._median_ms(lambda: calls.append("propose"), 3, between=lambda: calls.append("step")) >= 0
    assert calls == ["step", "propose"] * 3  # the step before each timed call
