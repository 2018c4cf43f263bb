"""Throughput under concurrency: NONE, every fixed DFLASH block and --speculative-adaptive, same run.

    python -m sgl_dflash.tools.bench_concurrency --speculative-token-map <drafter>/token_map.json
    python -m sgl_dflash.tools.bench_concurrency --datasets gsm8k mixed --concurrency 1 32 --block-sizes 4

For each prompt set (gsm8k, math500, humaneval, mbpp, mt-bench from sgl_dflash.tools.datasets, and
"mixed": math and chat prompts alternating) and each concurrency level c, every configuration
serves the same prompts through its scheduler with c requests in flight (a closed loop: a request
joins as soon as one finishes, like c clients each sending their next prompt), greedy, chat
template. Engines use the engine's defaults (context, KV budget, running requests) and live side
by side in one process; on every (set, c) row they take scheduler steps in turn (who steps first
rotates per row) and each is timed over its own steps only, so a shared machine's changing load
falls on all of them alike. Each row is served until a pass in which no engine compiled anything
(at most --max-passes), and that pass is measured: a warm server has compiled the shapes a row
needs (prompt-length, batch and context buckets; JAX compiles on first use, seconds per shape on a
CPU), and one compile in a measured pass would outweigh the differences it measures. The adaptive
engine's finishing order, hence its prefill batches, can change while its policy learns, so it may
need a third pass where the others are warm after one. A row that never got a compile-free pass
says which engines' steps compiled in its measured pass and for how long; tokens/s leaves the
seconds JAX spent compiling out (a compile is once per shape in a server's life; the step's own
work stays in) and `full_tokens_per_s` keeps them. The headline tokens/s prices the pass's tail
(its last requests, running with fewer beside them) at the rate of c requests in flight
(`ClosedLoop`): a server at concurrency c has no tail.

Writes <out>/concurrency.json (tokens/s, ratios to NONE and to the best fixed block, outputs equal to
NONE's, chosen verify lengths) and <out>/concurrency.png (tokens/s per concurrency, one panel per set).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from jax_backend.compile_counter import CompileCounter

from sgl_dflash.tools import datasets
from sgl_dflash.tools.bench_engines import add_engine_args, make_engines, resolve_engine_args

SETS = (*datasets.BENCH_DATASETS, "mixed")


MIXED = ("gsm8k", "mt-bench", "math500", "mt-bench")  # the "mixed" set's sources, in turn


def take_prompts(name: str, count: int, start: int = 0) -> tuple[list[str], int]:
    """`count` prompts of set `name` from row `start` of each source on ("mixed": MIXED's sources
    in turn, each from its own next row), wrapping around a source that runs out (mt-bench has
    80): (prompts, how many of them repeat an earlier one of the list)."""
    names = MIXED if name == "mixed" else (name,)
    sources = {n: datasets.load_benchmark(n) for n in names}
    taken = dict.fromkeys(names, start)
    prompts, reused, seen = [], 0, set()
    for i in range(count):
        source = names[i % len(names)]
        rows = sources[source]
        prompt = rows[taken[source] % len(rows)]["prompt"]
        taken[source] += 1
        reused += prompt in seen
        seen.add(prompt)
        prompts.append(prompt)
    return prompts, reused


def prompt_sets(names: list[str], count: int, offset: int = 0) -> dict[str, list[str]]:
    """`count` prompts of each set from `offset` on; "mixed" (`take_prompts`) from `count + offset`
    on in each source (past the prompts the single sets use, where the source has them)."""
    return {name: take_prompts(name, count, offset + (count if name == "mixed" else 0))[0] for name in names}


class ClosedLoop:
    """One engine serving `prompts` through its scheduler with `concurrency` requests in flight,
    one scheduler step at a time; `seconds` counts only this engine's own steps.

    `steady_tokens_per_s` (the headline) is a warm server's throughput at concurrency c: the
    pass's tokens over the seconds its prefills took plus its decode tokens at the rate of the
    decode steps that ran with all c requests in flight, all less the seconds JAX spent compiling.
    So the pass's tail, where the last requests run with fewer beside them, is priced at the
    steady rate, and every prefill and every decode token is counted once. The tail is not the
    same for every engine: requests of equal length that start together (NONE, 1 token per step)
    finish together and leave none, while speculation staggers them.
    `tokens_per_s` (the headline until 2026-11-26) counts only the steps that ran with c requests
    in flight, prefills of joining requests included: every prefill of the pass, but not the tail's
    decode tokens, so it undercounts a staggering engine's decode (at c = 8 with 2c prompts about
    a fifth of adaptive's decode tokens fell in the tail); `full_tokens_per_s` is the same with the
    compile seconds (`compile_seconds`, of all steps) kept, and `all_steps_tokens_per_s` counts
    every step as it ran. A compile is once per shape in a server's life, but its seconds in a
    measured pass outweigh what the pass measures: adaptive's policy compiles a shape it explores."""

    def __init__(self, engine, prompts: list[list[int]], concurrency: int, max_new_tokens: int):
        self.scheduler, self.queue, self.running, self.done = engine.scheduler, list(prompts), [], {}
        self.concurrency, self.max_new_tokens, self.order, self.seconds = concurrency, max_new_tokens, {}, 0.0
        self.compiling_steps, self.compile_seconds, self.full_seconds, self.full_tokens = 0, 0.0, 0.0, 0
        self.full_compile_seconds = 0.0
        self.prefill_steps: list[tuple[int, int, float]] = []  # (prompts, prompt tokens, warm seconds)
        # Warm seconds (compiles left out) of the prefill steps, and the decode tokens: all of
        # them, and those of the decode steps with c requests in flight with those steps' seconds.
        self.prefill_seconds, self.decode_tokens, self.full_decode_tokens, self.full_decode_seconds = 0.0, 0, 0, 0.0
        CompileCounter.install()

    @property
    def finished(self) -> bool:
        return not (self.queue or self.running)

    def step(self) -> None:
        from sgl_dflash.managers.schedule_batch import Req, new_rid
        from sgl_dflash.sampling_params import SamplingParams

        start, compiles, compile_seconds = time.perf_counter(), CompileCounter.count, CompileCounter.seconds
        while self.queue and len(self.running) < self.concurrency:
            params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens)
            req = Req(new_rid(), self.queue.pop(0), params)
            self.order[req.rid] = len(self.order)
            self.scheduler.add_request(req)
            self.running.append(req)
        full, before = len(self.running) == self.concurrency, sum(len(r.output_ids) for r in self.running)
        fresh = [r for r in self.running if not r.output_ids]
        decode_steps = self.scheduler.stats["decode_steps"]
        self.scheduler.step()
        seconds = time.perf_counter() - start
        self.seconds += seconds
        compiling = CompileCounter.seconds - compile_seconds
        self.compiling_steps += CompileCounter.count > compiles
        self.compile_seconds += compiling
        tokens = sum(len(r.output_ids) for r in self.running) - before
        if self.scheduler.stats["decode_steps"] == decode_steps:  # a prefill step
            self.prefill_seconds += seconds - compiling
            joined = [r for r in fresh if r.output_ids]
            self.prefill_steps.append((len(joined), sum(len(r.input_ids) for r in joined), seconds - compiling))
        else:
            self.decode_tokens += tokens
            if full:
                self.full_decode_tokens += tokens
                self.full_decode_seconds += seconds - compiling
        if full:  # c requests in flight: not the pass's tail, where the last requests run alone
            self.full_seconds += seconds
            self.full_compile_seconds += compiling
            self.full_tokens += tokens
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self.done[self.order[req.rid]] = req

    def result(self) -> dict:
        reqs = [self.done[i] for i in range(len(self.done))]
        tokens = sum(len(r.output_ids) for r in reqs)
        warm_seconds = self.full_seconds - self.full_compile_seconds
        decode_rate = self.full_decode_tokens / max(self.full_decode_seconds, 1e-9)  # tokens/s at c in flight
        steady_seconds = self.prefill_seconds + self.decode_tokens / max(decode_rate, 1e-9)
        result = {"tokens": tokens, "seconds": self.seconds, "steady_tokens_per_s": tokens / max(steady_seconds, 1e-9),
                  "prefill_seconds": self.prefill_seconds, "decode_tokens": self.decode_tokens,
                  "full_decode_tokens": self.full_decode_tokens, "full_decode_seconds": self.full_decode_seconds,
                  "tokens_per_s": self.full_tokens / max(warm_seconds, 1e-9),
                  "full_tokens_per_s": self.full_tokens / max(self.full_seconds, 1e-9),
                  "all_steps_tokens_per_s": tokens / self.seconds, "full_seconds": self.full_seconds,
                  "compiling_steps": self.compiling_steps, "compile_seconds": self.compile_seconds,
                  "prefill_steps": self.prefill_steps,
                  "outputs": [list(r.output_ids) for r in reqs]}
        if reqs and reqs[0].spec_verify_ct:
            steps = sum(r.spec_verify_ct for r in reqs)
            drafts = sum(r.spec_num_proposed_drafts for r in reqs)
            result.update(
                tokens_per_step=(tokens - len(reqs)) / max(1, steps),  # the first token is the prefill's
                mean_verify_len=drafts / max(1, steps),
                no_spec_fraction=sum(r.spec_no_spec_steps for r in reqs) / max(1, steps),
                accept_rate=sum(r.spec_num_correct_drafts for r in reqs) / max(1, drafts),
            )
        return result


def serve(engines: dict, prompts: list[list[int]], concurrency: int, max_new_tokens: int) -> dict[str, dict]:
    """Every engine serves `prompts` in a closed loop of `concurrency`; the engines take scheduler
    steps in turn, so that a shared machine's changing load falls on all of them alike (each is
    timed over its own steps only)."""
    loops = {name: ClosedLoop(engine, prompts, concurrency, max_new_tokens) for name, engine in engines.items()}
    while not all(loop.finished for loop in loops.values()):
        for loop in loops.values():
            if not loop.finished:
                loop.step()
    return {name: loop.result() for name, loop in loops.items()}


def serve_warm(engines: dict, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
               max_passes: int) -> tuple[dict[str, dict], int]:
    """`serve` until a pass (the second at the earliest) in which no engine compiled anything,
    at most `max_passes` times: (that pass's results, passes served)."""
    for passes in range(1, max_passes + 1):
        row = serve(engines, prompts, concurrency, max_new_tokens)
        if passes > 1 and not any(r["compiling_steps"] for r in row.values()):
            break
    return row, passes


METRIC = "steady_tokens_per_s"  # the headline (ClosedLoop); "tokens_per_s" was until 2026-11-26


def summarize(row: dict, fixed: list[str]) -> dict:
    """Ratios of one (set, concurrency) row: each config / NONE, adaptive / best fixed block, by
    the headline metric; the same by `tokens_per_s` (c in flight only) under "... (c in flight)"."""
    out = {}
    for metric, suffix in ((METRIC, ""), ("tokens_per_s", " (c in flight)")):
        none = row["NONE"][metric]
        best = max(fixed, key=lambda name: row[name][metric]) if fixed else None
        out["best_fixed" + suffix] = best
        for name, r in row.items():
            out[f"{name}/NONE{suffix}"] = r[metric] / none
        if best is not None:
            out["adaptive/best_fixed" + suffix] = row["adaptive"][metric] / row[best][metric]
    return out


def run(args) -> dict:
    from sgl_dflash.tools.train.regenerate import chat_prompt_ids

    engines = make_engines(args)
    tokenizer = engines["NONE"].tokenizer
    count = max(args.num_prompts, *(2 * c for c in args.concurrency))
    sets = {name: [chat_prompt_ids(tokenizer, p) for p in prompts]
            for name, prompts in prompt_sets(args.datasets, count).items()}
    names = list(engines)
    progress = tqdm(total=len(args.concurrency) * len(sets), desc="bench_concurrency", unit="row")

    results = {"config": vars(args) | {"out": str(args.out)}, "machine": _machine(), "rows": {}}
    fixed = [n for n in names if n.startswith("B=")]
    for set_name, prompts in sets.items():
        for c in args.concurrency:
            first = len(results["rows"]) % len(names)
            turn = names[first:] + names[:first]  # rotate who steps first
            group = {name: engines[name] for name in turn}
            progress.set_postfix_str(f"{set_name} c={c}")
            row, passes = serve_warm(group, prompts[: max(2 * c, args.num_prompts)], c, args.max_new_tokens,
                                     args.max_passes)
            progress.update()
            row = {name: row[name] for name in names}
            base = row["NONE"]["outputs"]
            for name, r in row.items():
                r["exact"] = sum(a == b for a, b in zip(r.pop("outputs"), base))
                r["num_prompts"] = len(base)
            key = f"{set_name}/c={c}"
            results["rows"][key] = {"results": row, "summary": summarize(row, fixed), "passes": passes}
            progress.write(format_row(key, results["rows"][key]))
            save(results, args.out)  # a partial run keeps what it measured
    progress.close()
    results["machine"]["load_average_end"] = _machine()["load_average"]
    return results


def save(results: dict, out: Path, name: str = "concurrency.json") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return path


def _machine() -> dict:
    import os
    import platform

    import jax

    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "jax_backend": jax.default_backend(),
            "load_average": os.getloadavg()}


def format_row(key: str, row: dict) -> str:
    r, s = row["results"], row["summary"]
    cells = " ".join(f"{name} {v[METRIC]:.1f}" for name, v in r.items())
    extra = ""
    if "adaptive/best_fixed" in s:
        a = r["adaptive"]
        extra = (f" | adaptive/NONE {s['adaptive/NONE']:.2f} adaptive/{s['best_fixed']} {s['adaptive/best_fixed']:.2f}"
                 f" (c in flight only: {s['adaptive/NONE (c in flight)']:.2f}, {s['adaptive/best_fixed (c in flight)']:.2f})"
                 f" | k {a['mean_verify_len']:.2f} no-spec {a['no_spec_fraction']:.2f}")
    exact = min(v["exact"] for v in r.values())
    compiled = ", ".join(f"{name} {v['compiling_steps']} ({v.get('compile_seconds', 0.0):.1f} s)"
                         for name, v in r.items() if v.get("compiling_steps"))
    return (f"{key}: steady tok/s {cells}{extra} | exact >= {exact}/{next(iter(r.values()))['num_prompts']}"
            f" | passes {row.get('passes', '?')}, steps that compiled (compile time left out of tok/s): {compiled or 'none'}")


def format_table(results: dict) -> str:
    rows = results["rows"]
    configs = list(next(iter(rows.values()))["results"])
    head = ("| set | c | " + " | ".join(configs)
            + " | adaptive/NONE | adaptive/best fixed | same, c in flight only | adaptive k, no-spec | exact |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, row in rows.items():
        set_name, c = key.split("/c=")
        r, s = row["results"], row["summary"]
        a = r["adaptive"]
        lines.append(
            f"| {set_name} | {c} | " + " | ".join(f"{r[n][METRIC]:.1f}" for n in configs)
            + f" | {s['adaptive/NONE']:.2f} | {s.get('adaptive/best_fixed', float('nan')):.2f} ({s['best_fixed']})"
            + f" | {s['adaptive/NONE (c in flight)']:.2f}, {s.get('adaptive/best_fixed (c in flight)', float('nan')):.2f}"
            + f" | {a['mean_verify_len']:.2f}, {a['no_spec_fraction']:.2f} | "
            + f"{min(v['exact'] for v in r.values())}/{a['num_prompts']} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    sets = list(dict.fromkeys(key.split("/c=")[0] for key in rows))
    configs = list(next(iter(rows.values()))["results"])
    fig, axes = plt.subplots(1, len(sets), figsize=(4 * len(sets), 3.6), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        keys = [k for k in rows if k.split("/c=")[0] == set_name]
        levels = [int(k.split("/c=")[1]) for k in keys]
        for name in configs:
            style = dict(lw=2.5, color="black") if name == "adaptive" else dict(lw=1, ls="--" if name == "NONE" else "-")
            ax.plot(levels, [rows[k]["results"][name][METRIC] for k in keys], marker="o", label=name, **style)
        ax.set(xscale="log", xticks=levels, xticklabels=[str(c) for c in levels], title=set_name,
               xlabel="concurrent requests", ylabel="tokens/s (steady)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--datasets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--num-prompts", type=int, default=4,
                        help="prompts per set and concurrency level c (at least 2c: every slot serves two)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[2, 4, 8], help="fixed DFLASH blocks")
    parser.add_argument("--max-passes", type=int, default=4,
                        help="serve a row until a pass compiles nothing (the measured pass), at most this often")
    args = parser.parse_args(argv)
    resolve_engine_args(args)
    results = run(args)
    save(results, args.out)
    png = plot(results, args.out / "concurrency.png")
    print(format_table(results))
    print("wrote", args.out / "concurrency.json", png)
    inexact = [f"{key} {name}" for key, row in results["rows"].items()
               for name, r in row["results"].items() if r["exact"] != r["num_prompts"]]
    if inexact:  # greedy outputs must equal NONE's: a mismatch is a bug, not a benchmark result
        raise SystemExit("outputs differ from NONE's: " + ", ".join(inexact))
    return results


if __name__ == "__main__":
    main()
