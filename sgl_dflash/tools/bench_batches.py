"""Issue 14's check as a benchmark: batches of unseen prompts served as `Engine.generate` serves
them, NONE vs --speculative-adaptive (and any fixed blocks), same run.

    python -m sgl_dflash.tools.bench_batches
    python -m sgl_dflash.tools.bench_batches --datasets gsm8k mt-bench mixed --batch-sizes 1 8 32 --repeats 2

Fresh engines with the engine's defaults live side by side in one process: NONE, the adaptive
engine (`speculative_num_draft_tokens=16`, `speculative_adaptive=True`) and, with --block-sizes,
fixed DFLASH blocks. Each call hands every engine the same batch of prompts it has not served
before (greedy, chat template, --max-new-tokens each), queued at once and served to the end as
`Engine.generate` serves it; the engines take scheduler steps in turn, so that a host whose speed
drifts slows them alike, and each is timed over its own steps: its prefill, its decode, and the
compiles of shapes it meets first (on a CPU seconds per shape, once per shape in a server's life;
the persistent compilation cache serves a later process). `tokens_per_s` counts them, as the
issue's check does; `warm_tokens_per_s` leaves JAX's compile seconds out. The first repeat meets
every shape first; later repeats show a warm server.

Prompts are taken in order, per set, without reuse until a set runs out (mt-bench has 80: two
repeats of 1 + 8 + 32 wrap around; the JSON counts the reused prompts). "mixed" takes gsm8k,
mt-bench, math500, mt-bench in turn (`bench_concurrency.take_prompts`).

Writes <out>/batches.json (per set, batch size and repeat: tokens, seconds, tokens/s, compile
seconds, outputs equal to NONE's, adaptive's chosen verify lengths; the ratios to NONE and their
median over repeats) and <out>/batches.png (adaptive / NONE per batch size, one panel per set).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

from tqdm import tqdm

from sgl_dflash.tools.bench_concurrency import SETS, _machine, save, serve, take_prompts
from sgl_dflash.tools.bench_engines import add_engine_args, make_engines, resolve_engine_args


def batch_result(loop: dict) -> dict:
    """One engine's share of `bench_concurrency.serve` over a whole batch: tokens, seconds of its
    own steps, JAX compile seconds among them, tokens/s with and without them, outputs, and (for a
    speculative engine) the mean chosen verify length and the fraction of steps without drafts."""
    keep = ("tokens", "seconds", "compile_seconds", "compiling_steps", "outputs", "prefill_seconds",
            "tokens_per_step", "mean_verify_len", "no_spec_fraction", "accept_rate")
    result = {k: loop[k] for k in keep if k in loop}
    result["tokens_per_s"] = loop["tokens"] / loop["seconds"]
    result["warm_tokens_per_s"] = loop["tokens"] / max(loop["seconds"] - loop["compile_seconds"], 1e-9)
    return result


def run_batches(engines: dict, prompts: list[list[int]], batch_sizes: list[int], repeats: int,
                max_new_tokens: int, progress=None) -> list[dict]:
    """Each batch (repeat by repeat, batch size by batch size, each the next prompts of `prompts`)
    is queued whole in every engine and served to the end, as `Engine.generate` serves it, with
    the engines taking scheduler steps in turn (`bench_concurrency.serve`: a host whose speed
    drifts within a minute slows both alike; timing whole calls one after the other read the
    same engine's batch-32 decode step at 120-250 ms from one call to the next). The engine
    stepping first rotates by batch size and repeat, so that each batch size has each engine
    first in turn (stepping first costs: 0.95-0.97 against 1.00-1.01, docs/adaptive.md
    2026-12-03; rotating call by call, three engines over three batch sizes had the same engine
    first at every batch size, 2026-12-04). One row per call: {"batch", "repeat", "first",
    "results": {engine: batch_result(...) + "exact"}}."""
    names, rows, cursor = list(engines), [], 0
    plan = [(r, b) for r in range(repeats) for b in batch_sizes]
    if sum(b for _, b in plan) > len(prompts):
        raise ValueError(f"{sum(b for _, b in plan)} prompts needed ({repeats} x {batch_sizes}), {len(prompts)} given")
    for repeat, (index, size) in ((r, b) for r in range(repeats) for b in enumerate(batch_sizes)):
        batch, cursor = prompts[cursor : cursor + size], cursor + size
        first = (index + repeat) % len(names)
        turn = {name: engines[name] for name in names[first:] + names[:first]}
        served = serve(turn, batch, concurrency=size, max_new_tokens=max_new_tokens)
        results = {name: batch_result(served[name]) for name in names}
        base = results["NONE"]["outputs"]
        for r in results.values():
            r["exact"] = sum(a == b for a, b in zip(r.pop("outputs"), base))
        rows.append({"batch": size, "repeat": repeat, "num_prompts": size, "first": names[first], "results": results})
        if progress is not None:
            progress.update()
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per batch size and engine: tokens/s over NONE's (wall and warm) per repeat, and the median
    over repeats."""
    out = {}
    for size in dict.fromkeys(r["batch"] for r in rows):
        calls = [r["results"] for r in rows if r["batch"] == size]
        for name in calls[0]:
            for metric in ("tokens_per_s", "warm_tokens_per_s"):
                ratios = [c[name][metric] / c["NONE"][metric] for c in calls]
                out[f"{size}/{name}/NONE/{metric}"] = {"per_repeat": ratios, "median": statistics.median(ratios)}
    return out


def format_rows(set_name: str, rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        r, none = row["results"], row["results"]["NONE"]
        cells = " ".join(f"{name} {v['tokens_per_s']:.1f} ({v['warm_tokens_per_s']:.1f})" for name, v in r.items())
        ratios = " ".join(f"{name}/NONE {v['tokens_per_s'] / none['tokens_per_s']:.2f}"
                          f" ({v['warm_tokens_per_s'] / none['warm_tokens_per_s']:.2f})"
                          for name, v in r.items() if name != "NONE")
        extra = ""
        if "adaptive" in r and "mean_verify_len" in r["adaptive"]:
            extra = f" | adaptive k {r['adaptive']['mean_verify_len']:.2f} no-spec {r['adaptive']['no_spec_fraction']:.2f}"
        exact = min(v["exact"] for v in r.values())
        lines.append(f"{set_name} batch {row['batch']} repeat {row['repeat']}: tok/s (warm) {cells} | {ratios}"
                     f"{extra} | exact {exact}/{row['num_prompts']}")
    return lines


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = results["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(4 * len(sets), 3.6), squeeze=False)
    for ax, (set_name, entry) in zip(axes[0], sets.items()):
        sizes = list(dict.fromkeys(r["batch"] for r in entry["rows"]))
        names = [n for n in entry["rows"][0]["results"] if n != "NONE"]
        for name, metric in itertools.product(names, ("tokens_per_s", "warm_tokens_per_s")):
            medians = [entry["summary"][f"{s}/{name}/NONE/{metric}"]["median"] for s in sizes]
            style = dict(lw=2.5, color="black") if name == "adaptive" else dict(lw=1)
            ax.plot(sizes, medians, marker="o", ls="-" if metric == "tokens_per_s" else ":",
                    label=f"{name} ({'wall' if metric == 'tokens_per_s' else 'warm'})", **style)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", xticks=sizes, xticklabels=[str(s) for s in sizes], title=set_name,
               xlabel="prompts per generate call", ylabel="tokens/s over NONE's (median of repeats)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    from sgl_dflash.tools.train.regenerate import chat_prompt_ids

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "mt-bench", "mixed"], choices=SETS)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=2, help="batches of each size per set (new prompts each)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-sizes", type=int, nargs="*", default=[], help="fixed DFLASH blocks beside")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.repeats < 1:
        parser.error("--batch-sizes and --repeats must be >= 1")
    resolve_engine_args(args)

    engines = make_engines(args)
    tokenizer = engines["NONE"].tokenizer
    count = args.repeats * sum(args.batch_sizes)
    results = {"config": vars(args) | {"out": str(args.out)}, "machine": _machine(), "sets": {}}
    progress = tqdm(total=len(args.datasets) * args.repeats * len(args.batch_sizes), desc="bench_batches", unit="call")
    for set_name in args.datasets:
        texts, reused = take_prompts(set_name, count)
        prompts = [chat_prompt_ids(tokenizer, p) for p in texts]
        rows = run_batches(engines, prompts, args.batch_sizes, args.repeats, args.max_new_tokens, progress)
        results["sets"][set_name] = {"rows": rows, "summary": summarize(rows), "reused_prompts": reused}
        for line in format_rows(set_name, rows):
            progress.write(line)
        save(results, args.out, "batches.json")  # a partial run keeps what it measured
    progress.close()
    results["machine"]["load_average_end"] = _machine()["load_average"]
    path = save(results, args.out, "batches.json")
    png = plot(results, args.out / "batches.png")
    print("wrote", path, png)
    inexact = [f"{s} batch {r['batch']} {name}" for s, e in results["sets"].items() for r in e["rows"]
               for name, v in r["results"].items() if v["exact"] != r["num_prompts"]]
    if inexact:  # greedy outputs must equal NONE's: a mismatch is a bug, not a benchmark result
        raise SystemExit("outputs differ from NONE's: " + ", ".join(inexact))
    return results


if __name__ == "__main__":
    main()
