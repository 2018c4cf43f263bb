"""sgl_dflash.tools.bench_batches (issue 14's check as a benchmark) on tiny engines: each call
hands every engine the next unseen batch, engines take turns going first, outputs and counts are
the engines' own, and the summary, table and plot follow the rows."""

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
    calls = []
    for name, engine in engines.items():
        generate = engine.generate

        def watched(*args, _name=name, _generate=generate, **kwargs):
            calls.append((_name, [list(p) for p in kwargs["input_ids"]]))
            return _generate(*args, **kwargs)

        monkeypatch.setattr(engine, "generate", watched)
    rows = bb.run_batches(engines, prompts, batch_sizes=[1, 3], repeats=2, max_new_tokens=7)
    monkeypatch.undo()

    assert [(r["batch"], r["repeat"]) for r in rows] == [(1, 0), (3, 0), (1, 1), (3, 1)]
    assert [name for name, _ in calls] == ["NONE", "adaptive", "adaptive", "NONE"] * 2  # who goes first rotates
    batches = [batch for name, batch in calls if name == "NONE"]
    assert batches == [prompts[0:1], prompts[1:4], prompts[4:5], prompts[5:8]]  # each call new prompts
    assert [batch for name, batch in calls if name == "adaptive"] == batches
    expected = [o["output_ids"] for o in none_engine.generate(
        input_ids=prompts[5:8], sampling_params={"temperature": 0.0, "max_new_tokens": 7})]
    last = rows[-1]["results"]
    for r in last.values():
        assert r["exact"] == 3 and r["tokens"] == sum(map(len, expected))
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert 0 <= r["compile_seconds"] and r["warm_tokens_per_s"] >= r["tokens_per_s"]
    assert 0.0 <= last["adaptive"]["mean_verify_len"] <= 7 and 0.0 <= last["adaptive"]["no_spec_fraction"] <= 1.0
    assert last["adaptive"]["accept_length"] >= 1.0 and "mean_verify_len" not in last["NONE"]

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


def test_unseen_prompts_go_in_order_and_count_what_wraps_around():
    prompts, reused = bb.unseen_prompts("mt-bench", 82)
    rows = [r["prompt"] for r in bb.datasets.load_benchmark("mt-bench")]
    assert prompts[:80] == rows and prompts[80:] == rows[:2] and reused == 2
    mixed, reused = bb.unseen_prompts("mixed", 8)
    gsm8k, math500 = (bb.datasets.load_benchmark(n) for n in ("gsm8k", "math500"))
    assert mixed[0::4] == [r["prompt"] for r in gsm8k[:2]] and mixed[2::4] == [r["prompt"] for r in math500[:2]]
    assert mixed[1::2] == rows[:4] and reused == 0
