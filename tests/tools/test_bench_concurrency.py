"""sgl_dflash.tools.bench_concurrency: the closed-loop serving pass on tiny engines (outputs and
counts as the engine's own), and the row summary, table and plot on a made-up row."""

from __future__ import annotations

import pytest

from sgl_dflash.tools import bench_concurrency as bc


def test_serve_keeps_concurrency_and_returns_the_engines_outputs(none_engine, dflash_engine, spec_prompts,
                                                                  monkeypatch):
    engine = dflash_engine(4)
    prompts = spec_prompts * 2
    scheduler, in_flight, turns = engine.scheduler, [], []
    step, none_step = scheduler.step, none_engine.scheduler.step

    def watched():
        in_flight.append(sum(not r.finished for r in scheduler.running) + len(scheduler.waiting))
        turns.append("B=4")
        return step()

    def none_watched():
        turns.append("NONE")
        return none_step()

    monkeypatch.setattr(scheduler, "step", watched)
    monkeypatch.setattr(none_engine.scheduler, "step", none_watched)
    both = bc.serve({"NONE": none_engine, "B=4": engine}, prompts, concurrency=3, max_new_tokens=9)
    assert max(in_flight) == 3 and in_flight[0] == 3  # c requests in flight, never more
    both_running = 2 * min(turns.count("NONE"), turns.count("B=4"))
    assert turns[:both_running] == ["NONE", "B=4"] * (both_running // 2)  # the engines step in turn
    monkeypatch.undo()
    expected = [o["output_ids"] for o in none_engine.generate(
        input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 9})]
    result = both["B=4"]
    assert result["outputs"] == both["NONE"]["outputs"] == expected  # in prompt order, as the engine's own
    assert result["tokens"] == sum(map(len, expected))
    assert result["all_steps_tokens_per_s"] == pytest.approx(result["tokens"] / result["seconds"])
    assert 0 < result["full_seconds"] <= result["seconds"] and result["tokens_per_s"] > 0  # c in flight only
    assert 1.0 <= result["tokens_per_step"] <= 4.0 and result["mean_verify_len"] == pytest.approx(3.0)
    assert result["no_spec_fraction"] == 0.0 and 0.0 <= result["accept_rate"] <= 1.0

    plain = bc.serve({"NONE": none_engine}, prompts, concurrency=8, max_new_tokens=9)["NONE"]
    assert plain["outputs"] == expected and "tokens_per_step" not in plain


def _result(tokens_per_s: float, exact: int = 4) -> dict:
    return {"tokens_per_s": tokens_per_s, "exact": exact, "num_prompts": 4, "mean_verify_len": 2.5,
            "no_spec_fraction": 0.25}


def test_summary_table_and_plot(tmp_path):
    row = {"NONE": _result(100.0), "B=4": _result(150.0), "B=8": _result(120.0), "adaptive": _result(165.0, exact=3)}
    summary = bc.summarize(row, ["B=4", "B=8"])
    assert summary["best_fixed"] == "B=4"
    assert summary["adaptive/NONE"] == pytest.approx(1.65) and summary["B=8/NONE"] == pytest.approx(1.2)
    assert summary["adaptive/best_fixed"] == pytest.approx(1.1)
    results = {"rows": {f"mixed/c={c}": {"results": row, "summary": summary} for c in (1, 4)}}
    table = bc.format_table(results).splitlines()
    assert table[0].startswith("| set | c | NONE | B=4 | B=8 | adaptive |") and len(table) == 4
    assert "| mixed | 4 | 100.0 | 150.0 | 120.0 | 165.0 | 1.65 | 1.10 (B=4) | 2.50, 0.25 | 3/4 |" == table[3]
    assert "exact >= 3/4" in bc.format_row("mixed/c=1", results["rows"]["mixed/c=1"])
    png = bc.plot(results, tmp_path / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closed_loop_counts_the_steps_that_compiled(none_engine, spec_prompts, monkeypatch):
    import jax
    import jax.numpy as jnp

    bc.serve({"NONE": none_engine}, spec_prompts, concurrency=2, max_new_tokens=5)  # shapes compiled
    step, calls = none_engine.scheduler.step, []

    def compiles_on_its_third_call():
        calls.append(1)
        if len(calls) == 3:
            jax.jit(lambda x: x * 3.0)(jnp.ones(5))  # a program never compiled before
        return step()

    monkeypatch.setattr(none_engine.scheduler, "step", compiles_on_its_third_call)
    result = bc.serve({"NONE": none_engine}, spec_prompts, concurrency=2, max_new_tokens=5)["NONE"]
    assert len(calls) > 3 and result["compiling_steps"] == 1
    # The compile's seconds are kept apart: tokens/s is a warm server's (the step's own work and
    # tokens stay in), the rate with the compile stays beside.
    assert 0 < result["compile_seconds"] < result["full_seconds"]
    warm_seconds = result["full_seconds"] - result["compile_seconds"]
    assert result["tokens_per_s"] == pytest.approx(result["full_tokens_per_s"] * result["full_seconds"] / warm_seconds)
    assert result["tokens_per_s"] > result["full_tokens_per_s"]


def test_serve_warm_measures_the_first_pass_without_compiles(monkeypatch):
    compiling = iter([4, 2, 1, 0, 0])  # compiling steps per pass
    monkeypatch.setattr(bc, "serve", lambda *a: {"NONE": {"compiling_steps": 0}, "adaptive": {"compiling_steps": next(compiling)}})
    row, passes = bc.serve_warm({}, [], 1, 8, max_passes=6)
    assert passes == 4 and row["adaptive"]["compiling_steps"] == 0
    compiling = iter([4, 2, 1, 0])
    row, passes = bc.serve_warm({}, [], 1, 8, max_passes=2)  # gives up: the last pass, as it is
    assert passes == 2 and row["adaptive"]["compiling_steps"] == 2
