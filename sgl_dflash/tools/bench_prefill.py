"""Prefill batches: the serving layout against the one before query tiles and fine token buckets.

    python -m sgl_dflash.tools.bench_prefill [--model-path DIR] [--repeats 5] [--out bench_results/prefill.json]

For each batch of prompts (lengths below; random token ids), the target's `TargetRunner.forward`
runs it two ways in one process, interleaved call by call so that a shared machine's drift falls
on both alike: "serving" (what the engine runs: token rows padded to `fine_bucket`, the new
tokens' attention in query tiles where they compute less) and "before" (`fine_tokens=False,
query_tiles=False`: power-of-two rows, a dense block of the longest prompt's size per sequence).
Each is compiled first (not timed). Writes JSON (median ms of each, their ratio, the padded
shapes, the largest logit difference between the two) and a PNG beside it.
Default model: SmolLM2-135M-Instruct (imported into cache/models on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from tqdm.auto import tqdm

# name -> prompt lengths: a long prompt among short ones (the closed-loop bench's first batch),
# equal prompts, and single prompts and pairs that a power-of-two bucket pads by up to half.
CASES = {
    "8 mixed, longest 310": [310, 100, 90, 120, 80, 60, 103, 80],
    "8 mixed, longest 229": [229, 100, 90, 120, 80, 60, 60, 80],
    "4: 200 + 3 x 30": [200, 30, 30, 30],
    "8 x 100": [100] * 8,
    "4 x 150": [150] * 4,
    "2 x 170": [170, 170],
    "1 x 140": [140],
    "1 x 77": [77],
    "16 x 40": [40] * 16,
}
VARIANTS = {"serving": {}, "before": {"fine_tokens": False, "query_tiles": False}}


def measure(runner, cases: dict[str, list[int]], repeats: int, progress: bool = True) -> list[dict]:
    import numpy as np

    from jax_backend import SeqInput

    rng = np.random.default_rng(0)
    rows = []
    for name, lengths in tqdm(cases.items(), desc="bench_prefill", unit="batch", disable=not progress):
        tables = [runner.allocator.allocate(("bench", i), n) for i, n in enumerate(lengths)]
        seqs = [SeqInput(rng.integers(0, runner.config.vocab_size, n).tolist(), 0, t) for n, t in zip(lengths, tables)]
        try:
            outputs = {v: runner.forward(seqs, **kw) for v, kw in VARIANTS.items()}  # compiles
            times = {v: [] for v in VARIANTS}
            for i in range(repeats):
                for v in list(VARIANTS)[:: 1 if i % 2 == 0 else -1]:
                    start = time.perf_counter()
                    runner.forward(seqs, **VARIANTS[v])
                    times[v].append(time.perf_counter() - start)
        finally:
            for i in range(len(lengths)):
                runner.allocator.free(("bench", i))
        shapes = {v: runner._batch(seqs, fine_tokens=kw.get("fine_tokens", True),
                                   query_tiles=kw.get("query_tiles", True))[0] for v, kw in VARIANTS.items()}
        ms = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        rows.append({
            "batch": name, "prompt_lengths": lengths, "tokens": sum(lengths),
            **{f"{v}_ms": ms[v] for v in VARIANTS},
            **{f"{v}_token_rows": int(shapes[v].tokens.shape[0]) for v in VARIANTS},
            "query_block": shapes["serving"].max_q_len, "query_tile": shapes["serving"].query_tile,
            "speedup": ms["before"] / ms["serving"],
            "max_logit_diff": max(float(np.abs(a - b).max()) for a, b in
                                  zip(outputs["serving"].logits, outputs["before"].logits)),
        })
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = range(len(rows))
    for offset, variant in ((-0.2, "before"), (0.2, "serving")):
        ax.bar([i + offset for i in x], [r[f"{variant}_ms"] for r in rows], width=0.4, label=variant)
    for i, r in enumerate(rows):
        ax.annotate(f"{r['speedup']:.2f}x", (i + 0.2, r["serving_ms"]), ha="center", va="bottom", fontsize=8)
    labels = [r["batch"].replace(", ", ",\n") + f"\n({r['tokens']} tok)" for r in rows]
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ms per prefill forward (median)")
    ax.set_title("Prefill: serving layout vs power-of-two rows + dense query blocks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m sgl_dflash.tools.bench_prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="target checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each variant per batch")
    parser.add_argument("--cases", nargs="+", default=None, metavar="L1,L2,..",
                        help="batches as comma-separated prompt lengths (default: the built-in set)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/prefill.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    try:
        cases = ({c: [int(n) for n in c.split(",")] for c in args.cases} if args.cases else CASES)
    except ValueError:
        parser.error(f"--cases takes comma-separated prompt lengths, got {args.cases}")
    if any(n < 1 for lengths in cases.values() for n in lengths):
        parser.error("prompt lengths must be >= 1")

    from jax_backend import TargetRunner
    from sgl_dflash.tools import model_import
    from sgl_dflash.tools.demo import use_compilation_cache

    use_compilation_cache()
    model_path = args.model_path or str(model_import.ensure_default_model())
    page = 16  # a batch's sequences hold its tokens plus at most a page each
    runner = TargetRunner(model_path, page_size=page,
                          max_total_tokens=max(sum(lens) + page * len(lens) for lens in cases.values()),
                          max_num_seqs=max(len(lens) for lens in cases.values()),
                          max_model_len=max(max(lens) for lens in cases.values()) + page)
    rows = measure(runner, cases, args.repeats)
    report = {"model_path": model_path, "repeats": args.repeats, "machine": {
        "platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print("| batch | tokens | rows before / serving | tile | before ms | serving ms | x |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['tokens']} | {r['before_token_rows']} / {r['serving_token_rows']} | "
              f"{r['query_tile']} | {r['before_ms']:.1f} | {r['serving_ms']:.1f} | {r['speedup']:.2f} |")
    print(f"wrote {args.out} {args.out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
