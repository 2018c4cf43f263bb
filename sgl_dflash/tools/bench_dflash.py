"""Benchmark: DFLASH vs NONE tokens/s in the same run, tau, and where a DFLASH step's time goes.

    python -m sgl_dflash.tools.bench_dflash [--block-sizes 4 8 16] [--batch-sizes 1 4] [--max-new-tokens 128]
                                      [--context-length N] [--dataset mt-bench --num-prompts 32]
                                      [--adaptive-bound 16]
                                      [--roofline] [--out bench_results/bench_dflash.json]

Runs on the small generated pair (built on first use; see sgl_dflash.tools.tiny_pair), or on
--model-path / --draft-path, with the engine's default settings (context length = the target's
maximum, as a user gets them) unless --context-length / --max-running-requests say otherwise.
Greedy decoding of chat prompts. Every configuration runs once to warm
up (JAX compiles) and once timed. A DFLASH decode step (one scheduler.step()) is split into draft
(drafter forward), verify (one jitted target step over all blocks, acceptance included), commit
(drafter state update) and host overhead: the rest of the step's wall time (scheduling,
page allocation, batching, applying the result: stop rules). Steps that compiled a program the
warm-up pass did not (an adaptive engine's choices differ between passes) are counted and timed
apart: `warm_tokens_per_s` leaves them out. Prints a table and writes JSON.

`--roofline` (issue 12's check) measures this machine's read bandwidth and fp32 matmul peak in the
same run (before and after the engines; the faster reading counts) and sets every row's decode
step beside its roofline: the target's weights and the KV of `batch` sequences at the row's mean
context, plus for DFLASH a verify block of K tokens per sequence and the drafter's weights
(`bench_roofline.roofline`). Writes the plot (step ms vs roofline ms) beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import jax

from sgl_dflash import tools
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.model_executor.forward_batch_info import ForwardMode
from sgl_dflash.server_args import DTYPES, LAYER_LOOPS
from sgl_dflash.tools import datasets
from sgl_dflash.tools.roofline import measure_machine, roofline, target_bytes, weight_bytes_read
from sgl_dflash.tools.demo import QUESTIONS, TINY_PAIR_QUESTIONS, chat_prompts, use_compilation_cache
from sgl_dflash.tools.tiny_pair import ensure_tiny_pair

PHASES = ("draft", "verify", "commit")


def timed_generate(engine: Engine, prompts: list[str], batch_size: int, max_new_tokens: int) -> dict[str, Any]:
    """Greedy generation in batches of `batch_size`, timing every scheduler step by kind."""
    scheduler, worker = engine.scheduler, engine.scheduler.worker
    clock = {"prefill": 0.0, "decode": 0.0, "decode_steps": 0, "compile_s": 0.0, "compiling_steps": 0}
    step, run = scheduler.step, worker.forward_batch_generation
    decoded = []

    def flagging_run(batch):
        decoded.append(batch.forward_mode is ForwardMode.DECODE)
        return run(batch)

    def timed_step():
        decoded.clear()
        compilations = worker.num_compilations()
        start = time.perf_counter()
        try:
            return step()
        finally:
            seconds = time.perf_counter() - start
            kind = "decode" if any(decoded) else "prefill"
            clock[kind] += seconds
            clock["decode_steps"] += kind == "decode"
            if worker.num_compilations() != compilations:
                # A shape the warm-up pass did not run (an adaptive engine's choices differ
                # between passes): a server pays it once, so it is reported apart.
                clock["compile_s"] += seconds
                clock["compiling_steps"] += 1

    scheduler.step, worker.forward_batch_generation = timed_step, flagging_run
    timings = getattr(worker, "timings", None)
    if timings is not None:
        timings.clear()
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    outputs = []
    start = time.perf_counter()
    try:
        for i in range(0, len(prompts), batch_size):
            outputs += engine.generate(prompt=prompts[i : i + batch_size], sampling_params=params)
    finally:
        scheduler.step, worker.forward_batch_generation = step, run
    wall = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    result = {
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
        "compile_s": clock["compile_s"], "compiling_steps": clock["compiling_steps"],
        "warm_tokens_per_s": tokens / (wall - clock["compile_s"]),
        "prefill_s": clock["prefill"], "decode_s": clock["decode"], "decode_steps": clock["decode_steps"],
        # The first token of each request comes from its prefill step.
        "decode_tokens_per_s": (tokens - len(outputs)) / max(clock["decode"], 1e-9),
        # The KV a mean decode step reads: the prompt and half the answer.
        "context": sum(o["meta_info"]["prompt_tokens"] + o["meta_info"]["completion_tokens"] / 2
                       for o in outputs) / len(outputs),
        "output_ids": [o["output_ids"] for o in outputs],
    }
    steps = max(1, clock["decode_steps"])
    result["decode_step_ms"] = clock["decode"] / steps * 1e3
    if timings is not None:
        verify_steps = sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
        result["tau"] = (tokens - len(outputs)) / max(1, verify_steps)  # the first token is the prefill's
        if hasattr(worker, "policy"):  # adaptive: the drafts it verified per step, and its plain steps
            metas = [o["meta_info"] for o in outputs]
            result["mean_verify_len"] = sum(m["spec_mean_verify_len"] * m["spec_verify_ct"] for m in metas) / max(1, verify_steps)
            result["no_spec_fraction"] = sum(m["spec_no_spec_fraction"] * m["spec_verify_ct"] for m in metas) / max(1, verify_steps)
        split = {phase: timings[phase] / steps * 1e3 for phase in PHASES}
        # Host overhead: the rest of a decode step (scheduling, page allocation, batching).
        split["host_overhead"] = result["decode_step_ms"] - sum(split.values())
        result["step_ms"] = split
    return result


def add_roofline(engines: dict[str, Engine], rows: list[dict], machine: dict) -> None:
    """Each row's decode step against its roofline (see the module doc); `machine` as
    `roofline.measure_machine` returns it."""
    runner = engines["NONE"].scheduler.worker.runner
    weights = target_bytes(runner)
    for row in rows:
        worker = engines[row["config"]].scheduler.worker
        if hasattr(worker, "policy"):
            continue  # adaptive: every step has its own verify lengths, no one roofline
        k, drafter = 1, 0
        if hasattr(worker, "proposer"):
            k = worker.block_size
            drafter = sum(x.nbytes for x in jax.tree_util.tree_leaves(worker.proposer.params))
            drafter += worker.proposer.lm_head.nbytes
        line = roofline(runner.config, weights, row["batch_size"], k, round(row["context"]), machine, drafter)
        tokens_per_step = row["batch_size"] * row.get("tau", 1.0)
        row.update(roofline_ms=line["roofline_ms"], roofline_bound=line["bound"],
                   step_over_roofline=round(row["decode_step_ms"] / line["roofline_ms"], 2),
                   roofline_tokens_per_s=round(tokens_per_step / line["roofline_ms"] * 1e3, 1))
        # Against the bytes the step reads: GGUF blocks for the target's few-row products.
        read = roofline(runner.config, weight_bytes_read(runner, row["batch_size"] * k), row["batch_size"], k,
                        round(row["context"]), machine, drafter)
        row.update(roofline_read_ms=read["roofline_ms"], step_over_roofline_read=round(row["decode_step_ms"] / read["roofline_ms"], 2))


def plot_roofline(rows: list[dict], machine: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{r['config']}\nbatch {r['batch_size']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    ax.bar(x - 0.2, [r["decode_step_ms"] for r in rows], 0.4, label="engine decode step")
    ax.bar(x + 0.2, [r["roofline_ms"] for r in rows], 0.4, label="roofline")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['step_over_roofline']:.1f}x", (i - 0.2, r["decode_step_ms"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Engine decode steps vs their roofline\n({machine['read_bandwidth_gbs']:.0f} GB/s read, "
                 f"{machine['matmul_fp32_gflops']:.0f} GFLOP/s fp32, measured in the same run)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--draft-path", default=None)
    parser.add_argument("--speculative-token-map", default=None, help=tools.TOKEN_MAP_HELP)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--context-length", type=int, default=None,
                        help="default: what a user gets (the target's max_position_embeddings)")
    parser.add_argument("--max-running-requests", type=int, default=None, help="default: the server default")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="the target's dtype (default: the engine's auto = float32 on CPU, bfloat16 elsewhere; "
                             "greedy outputs are token-identical to NONE's in float32)")
    parser.add_argument("--dataset", default=None, choices=datasets.BENCH_DATASETS,
                        help="prompts from this benchmark set (sgl_dflash.tools.datasets, e.g. mt-bench) "
                             "instead of the demo questions")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="with --dataset: how many prompts (default: the largest batch size)")
    parser.add_argument("--adaptive-bound", type=int, default=0, metavar="B",
                        help="also an adaptive engine (--speculative-adaptive) with this upper bound, e.g. 16")
    parser.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto",
                        help="how the target runs its decoder layers (ServerArgs.layer_loop)")
    parser.add_argument("--unroll-layers", action="store_true", help="--layer-loop unrolled")
    parser.add_argument("--roofline", action="store_true",
                        help="measure bandwidth and matmul peak in the same run; each step vs its roofline")
    parser.add_argument("--out", default="bench_results/bench_dflash.json")
    args = parser.parse_args(argv)

    use_compilation_cache()
    questions = QUESTIONS
    if args.model_path is None:
        model = ensure_tiny_pair()
        args.model_path, args.draft_path = model.target_dir, model.draft_dir
        questions = TINY_PAIR_QUESTIONS  # what the small pair was trained to answer
    if args.dataset is not None:
        records = datasets.load_benchmark(args.dataset)
        questions = [record["prompt"] for record in records[: args.num_prompts or max(args.batch_sizes)]]
    if max(args.batch_sizes) > len(questions):
        parser.error(f"--batch-sizes {max(args.batch_sizes)} needs at least that many prompts, have "
                     f"{len(questions)}: pass --dataset (e.g. mt-bench) and --num-prompts")
    # The engine's defaults unless asked otherwise: a user's configuration, not a tuned one.
    common = dict(model_path=args.model_path, random_seed=0, layer_loop=args.layer_loop,
                  unroll_layers=args.unroll_layers)  # ServerArgs.check resolves the older spelling
    if args.context_length is not None:
        common["context_length"] = args.context_length
    if args.max_running_requests is not None:
        common["max_running_requests"] = args.max_running_requests
    if args.dtype is not None:
        common["dtype"] = args.dtype
    engines = {"NONE": Engine(**common)}
    spec = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=args.draft_path,
                speculative_token_map=args.speculative_token_map)
    for block_size in args.block_sizes:
        engines[f"DFLASH-b{block_size}"] = Engine(**common, **spec, speculative_num_draft_tokens=block_size)
    if args.adaptive_bound:
        engines["DFLASH-adaptive"] = Engine(**common, **spec, speculative_num_draft_tokens=args.adaptive_bound,
                                            speculative_adaptive=True)
    prompts = chat_prompts(engines["NONE"].tokenizer, questions)
    machines = []
    if args.roofline:
        machines.append(measure_machine(jax.default_backend() != "cpu"))

    rows = []
    for batch_size in args.batch_sizes:
        results = {}
        for name, engine in engines.items():
            timed_generate(engine, prompts, batch_size, args.max_new_tokens)  # warm-up: compiles
            results[name] = timed_generate(engine, prompts, batch_size, args.max_new_tokens)
        base = results["NONE"]
        for name, r in results.items():
            row = {"config": name, "batch_size": batch_size, "tokens_per_s": round(r["tokens_per_s"], 1),
                   "speedup_vs_none": round(r["tokens_per_s"] / base["tokens_per_s"], 2),
                   "warm_tokens_per_s": round(r["warm_tokens_per_s"], 1),
                   "warm_speedup_vs_none": round(r["warm_tokens_per_s"] / base["warm_tokens_per_s"], 2),
                   "compiling_steps": r["compiling_steps"], "compile_s": round(r["compile_s"], 2),
                   "decode_steps": r["decode_steps"], "tokens": r["tokens"],
                   "identical_to_none": r["output_ids"] == base["output_ids"],
                   "prefill_s": round(r["prefill_s"], 3), "decode_step_ms": round(r["decode_step_ms"], 2),
                   "decode_tokens_per_s": round(r["decode_tokens_per_s"], 1), "context": round(r["context"], 1)}
            for key in ("mean_verify_len", "no_spec_fraction"):
                if key in r:
                    row[key] = round(r[key], 3)
            if "tau" in r:
                row["tau"] = round(r["tau"], 2)
                row["step_ms"] = {k: round(v, 2) for k, v in r["step_ms"].items()}
            rows.append(row)

    machine = None
    if args.roofline:
        machines.append(measure_machine(jax.default_backend() != "cpu"))
        machine = {key: max(m[key] for m in machines) for key in ("read_bandwidth_gbs", "matmul_fp32_gflops")}
        add_roofline(engines, rows, machine)

    header = (f"{'config':<15} {'batch':>5} {'tok/s':>8} {'x NONE':>7} {'warm x':>7} {'compiles':>8} {'tau':>5} "
              f"{'same':>5} {'step ms':>8}  split (ms): " + " / ".join(PHASES + ("host_overhead",)))
    print(header)
    for row in rows:
        split = " / ".join(f"{row['step_ms'][k]:.2f}" for k in PHASES + ("host_overhead",)) if "step_ms" in row else ""
        print(f"{row['config']:<15} {row['batch_size']:>5} {row['tokens_per_s']:>8.1f} {row['speedup_vs_none']:>7.2f} "
              f"{row['warm_speedup_vs_none']:>7.2f} {row['compiling_steps']:>3} {row['compile_s']:>4.1f}s "
              f"{row.get('tau', 1.0):>5.2f} {str(row['identical_to_none']):>5} {row['decode_step_ms']:>8.2f}  {split}")
    print("(warm x: tokens/s without the steps that compiled, which a running server pays once)")
    if machine is not None:
        print(f"\nroofline: read bandwidth {machine['read_bandwidth_gbs']:.1f} GB/s, fp32 matmul "
              f"{machine['matmul_fp32_gflops']:.0f} GFLOP/s (best of {len(machines)} readings in this run)")
        print(f"{'config':<15} {'batch':>5} {'context':>7} {'step ms':>8} {'roofline':>8} {'x':>6} "
              f"{'decode tok/s':>12} {'ceiling':>8}")
        for row in (r for r in rows if "roofline_ms" in r):
            print(f"{row['config']:<15} {row['batch_size']:>5} {row['context']:>7.0f} {row['decode_step_ms']:>8.2f} "
                  f"{row['roofline_ms']:>8.2f} {row['step_over_roofline']:>6.2f} {row['decode_tokens_per_s']:>12.1f} "
                  f"{row['roofline_tokens_per_s']:>8.1f}")
    server_args = engines["NONE"].server_args
    report = {
        "model_path": args.model_path, "draft_path": args.draft_path, "max_new_tokens": args.max_new_tokens,
        "context_length": server_args.context_length, "max_running_requests": server_args.max_running_requests,
        "max_total_tokens": server_args.max_total_tokens, "dtype": server_args.resolved_dtype,
        "layer_loop": server_args.layer_loop, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "backend": jax.default_backend(),
        "num_prompts": len(prompts), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                 "load_avg": os.getloadavg()},
        "results": rows,
    }
    if machine is not None:
        report["roofline_machine"] = {**machine, "readings": machines, "backend": jax.default_backend(),
                                      "device": str(jax.devices()[0])}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    if machine is not None:
        plot_path = os.path.splitext(args.out)[0] + ".png"
        plot_roofline([r for r in rows if "roofline_ms" in r], machine, plot_path)
        print(f"wrote {plot_path}")
    return report


if __name__ == "__main__":
    main()
