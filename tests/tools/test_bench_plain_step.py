"""sgl_dflash.tools.bench_plain_step on tiny engines: the adaptive engine forced plain never
drafts, its steps pair with NONE's, the outputs agree, and the summary and plot are written."""

from __future__ import annotations

import pytest

from sgl_dflash.tools import bench_plain_step as bps


@pytest.fixture(scope="module")
def plain_adaptive(engine_kwargs, trained_draft_dir):
    from sgl_dflash.entrypoints.engine import Engine

    engine = Engine(**engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_draft_dir,
                    speculative_adaptive=True, disable_precompile=True)
    bps.force_plain(engine)
    return engine


def test_pairs_of_plain_steps_and_their_summary(none_engine, plain_adaptive, spec_prompts, tmp_path):
    engines = {"NONE": none_engine, "adaptive": plain_adaptive}
    measured = bps.measure(engines, spec_prompts[:3], steps=6, warmup=2)
    assert measured["exact"]  # greedy: the plain steps generate NONE's tokens
    assert [len(t) for t in measured["times"].values()] == [6, 6] and len(measured["parts"]) == 6
    worker = plain_adaptive.scheduler.worker
    assert worker.timings["drafted_steps"] == 0  # forced plain: nothing drafted, ever
    assert not any(engine.scheduler.has_work() for engine in engines.values())  # every request finished
    for plan, device, rest in measured["parts"]:
        assert plan >= 0 and device > 0  # the parts come from the worker's own clock
    row = bps.summarize(3, measured)
    assert row["batch"] == 3 and row["steps"] == 6 and row["exact"]
    assert row["adaptive_over_none"] > 0 and set(row["adaptive_parts_ms"]) == set(bps.PARTS)
    png = bps.plot([row, dict(row, batch=8)], tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
