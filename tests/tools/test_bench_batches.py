"""sgl_dflash.tools.bench_batches (issue 14's check as a benchmark) on tiny engines: each call
queues the next unseen batch whole in every engine, the engines step in turn, outputs and counts
are the engines' own, and the summary, table and plot follow the rows."""

from __future__ import annotations

import pytest

from sgl_dflash.tools import bench_batches as bb


@pytest.fixture(scope="module")
def adaptive_engine(engine_kwargs, trained_draft_dir):
    from sgl_dflash.entrypoints.engine import Engine

    return Engine(**engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_draft_dir,
                  speculative_num_draft_tokens=16, speculative_adaptive=True, disable_precompile=True)


def test_batches_are_new_prompts_in_turn_and_exact(none_engine, adaptive_engine, spec_prompts, monkeypatch,
                                                   tmp_path):
    prompts = [p + [i + 1] for i in range(3) for p in spec_prompts]  # distinct prompts, several per call
    engines = {"NONE": none_engine, "adaptive": adaptive_engine}
    queued, stepped = [], []
    for name, engine in engines.items():
        add, step = engine.scheduler.add_request, engine.scheduler.step

        def watched_add(req, _name=name, _add=add):
            queued.append((_name, list(req.input_ids)))
            return _add(req)

        def watched_step(_name=name, _step=step):
            stepped.append(_name)
            return _step()

        monkeypatch.setattr(engine.scheduler, "add_request", watched_add)
        monkeypatch.setattr(engine.scheduler, "step", watched_step)
    rows = bb.run_batches(engines, prompts, batch_sizes=[1, 3], repeats=2, max_new_tokens=7)
    monkeypatch.undo()

    assert [(r["batch"], r["repeat"], r["first"]) for r in rows] == [
        (1, 0, "NONE"), (3, 0, "adaptive"), (1, 1, "adaptive"), (3, 1, "NONE")]  # each size has each engine first
    for name in engines:  # each call queues the whole batch of new prompts
        assert [ids for n, ids in queued if n == name] == prompts[:8]
    assert stepped[:2] == ["NONE", "adaptive"] and "NONE" in stepped[-4:]  # the engines step in turn
    expected = [o["output_ids"] for o in none_engine.generate(
        input_ids=prompts[5:8], sampling_params={"temperature": 0.0, "max_new_tokens": 7})]
    last = rows[-1]["results"]
    for r in last.values():
        assert r["exact"] == 3 and r["tokens"] == sum(map(len, expected))
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert 0 <= r["compile_seconds"] and r["warm_tokens_per_s"] >= r["tokens_per_s"]
    assert 0.0 <= last["adaptive"]["mean_verify_len"] <= 7 and 0.0 <= last["adaptive"]["no_spec_fraction"] <= 1.0
    assert last["adaptive"]["tokens_per_step"] >= 1.0 and "mean_verify_len" not in last["NONE"]

    summary = bb.summarize(rows)
    ratio = summary["3/adaptive/NONE/tokens_per_s"]
    assert ratio["per_repeat"] == [pytest.approx(r["results"]["adaptive"]["tokens_per_s"] / r["results"]["NONE"]["tokens_per_s"])
                                   for r in rows if r["batch"] == 3]
    assert summary["1/NONE/NONE/warm_tokens_per_s"]["median"] == pytest.approx(1.0)
    lines = bb.format_rows("tiny", rows)
    assert len(lines) == 4 and lines[1].startswith("tiny batch 3 repeat 0:") and "exact 3/3" in lines[1]
    png = bb.plot({"sets": {"tiny": {"rows": rows, "summary": summary}}}, tmp_path / "b.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="8 prompts needed"):
        bb.run_batches(engines, prompts[:7], batch_sizes=[1, 3], repeats=2, max_new_tokens=7)
