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
    for r in both.values():  # every prompt joins in exactly one prefill step
        assert sum(n for n, _, _ in r["prefill_steps"]) == len(prompts)
        assert sum(t for _, t, _ in r["prefill_steps"]) == sum(map(len, prompts))
        assert sum(s for _, _, s in r["prefill_steps"]) == pytest.approx(r["prefill_seconds"])

    plain = bc.serve({"NONE": none_engine}, prompts, concurrency=8, max_new_tokens=9)["NONE"]
    assert plain["outputs"] == expected and "tokens_per_step" not in plain


def _result(steady: float, exact: int = 4, in_flight: float | None = None) -> dict:
    return {"steady_tokens_per_s": steady, "tokens_per_s": steady if in_flight is None else in_flight, "exact": exact,
            "num_prompts": 4, "mean_verify_len": 2.5, "no_spec_fraction": 0.25}


def test_summary_table_and_plot(tmp_path):
    row = {"NONE": _result(100.0), "B=4": _result(150.0), "B=8": _result(120.0, in_flight=160.0),
           "adaptive": _result(165.0, exact=3, in_flight=144.0)}
    summary = bc.summarize(row, ["B=4", "B=8"])
    assert summary["best_fixed"] == "B=4" and summary["best_fixed (c in flight)"] == "B=8"
    assert summary["adaptive/NONE"] == pytest.approx(1.65) and summary["B=8/NONE"] == pytest.approx(1.2)
    assert summary["adaptive/best_fixed"] == pytest.approx(1.1)
    assert summary["adaptive/NONE (c in flight)"] == pytest.approx(1.44)
    assert summary["adaptive/best_fixed (c in flight)"] == pytest.approx(0.9)
    results = {"rows": {f"mixed/c={c}": {"results": row, "summary": summary} for c in (1, 4)}}
    table = bc.format_table(results).splitlines()
    assert table[0].startswith("| set | c | NONE | B=4 | B=8 | adaptive |") and len(table) == 4
    assert "| mixed | 4 | 100.0 | 150.0 | 120.0 | 165.0 | 1.65 | 1.10 (B=4) | 1.44, 0.90 | 2.50, 0.25 | 3/4 |" == table[3]
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


class _FakeScheduler:
    """A prefill costs 1 s per request, a decode step 0.5 s whatever its batch; the i-th request
    to arrive emits rates[i % len(rates)] tokens per decode step (a speculative engine's requests
    finish apart)."""

    def __init__(self, clock: list[float], rates: list[int], max_new_tokens: int):
        self.clock, self.rates, self.max_new_tokens = clock, rates, max_new_tokens
        self.waiting, self.running, self.rate, self.stats = [], [], {}, {"decode_steps": 0}

    def add_request(self, req) -> None:
        self.rate[req.rid] = self.rates[len(self.rate) % len(self.rates)]
        self.waiting.append(req)

    def step(self) -> None:
        if self.waiting:
            self.clock[0] += 1.0 * len(self.waiting)
            for req in self.waiting:
                req.output_ids.append(0)
            self.running, self.waiting = self.running + self.waiting, []
        else:
            self.clock[0] += 0.5
            self.stats["decode_steps"] += 1
            for req in self.running:
                req.output_ids += [0] * min(self.rate[req.rid], self.max_new_tokens - len(req.output_ids))
        for req in [r for r in self.running if len(r.output_ids) == self.max_new_tokens]:
            req.finished_reason = {"type": "length"}
            self.running.remove(req)


@pytest.mark.parametrize("rates, steady, all_steps", [
    ([1], 3.0, 3.0),  # equal finishes (NONE): no tail, every measure agrees
    # 2 and 1 tokens a step: the last request decodes alone for 4 s (the tail); the steady rate
    # prices its 8 tokens at the 6 tokens/s of two requests in flight.
    ([2, 1], 36 / (4 + 32 / 6), 3.0),
])
def test_steady_rate_prices_the_tail_at_c_in_flight(monkeypatch, rates, steady, all_steps):
    import types

    clock = [0.0]
    monkeypatch.setattr(bc, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = types.SimpleNamespace(scheduler=_FakeScheduler(clock, rates, max_new_tokens=9))
    loop = bc.ClosedLoop(engine, [[1, 2, 3]] * 4, concurrency=2, max_new_tokens=9)
    while not loop.finished:
        loop.step()
    result = loop.result()
    assert result["tokens"] == 36 and result["prefill_seconds"] == 4.0 and result["decode_tokens"] == 32
    assert result["steady_tokens_per_s"] == pytest.approx(steady)
    assert result["all_steps_tokens_per_s"] == pytest.approx(all_steps)


def test_prompts_go_in_order_without_repeats_until_a_source_runs_out():
    mt_bench = [r["prompt"] for r in bc.datasets.load_benchmark("mt-bench")]
    prompts, reused = bc.take_prompts("mt-bench", 82)
    assert prompts[:80] == mt_bench and prompts[80:] == mt_bench[:2] and reused == 2
    gsm8k, math500 = ([r["prompt"] for r in bc.datasets.load_benchmark(n)] for n in ("gsm8k", "math500"))
    mixed, reused = bc.take_prompts("mixed", 8, start=3)
    assert mixed[0::4] == gsm8k[3:5] and mixed[2::4] == math500[3:5] and mixed[1::2] == mt_bench[3:7]
    assert reused == 0
    sets = bc.prompt_sets(["mt-bench", "mixed"], 64)
    assert sets["mt-bench"] == mt_bench[:64]
    assert len(set(sets["mixed"])) == 64  # each chat prompt once (before 2026-11-28 each came twice)
    assert sets["mixed"][:4] == [gsm8k[64], mt_bench[64], math500[64], mt_bench[65]]
