"""Speculative decoding benchmark on real prompt sets: DFLASH vs NONE on the same engine, same run.

    python -m sgl_dflash.bench                                   # embedded default target + drafter
    python -m sgl_dflash.bench --datasets gsm8k mbpp --num-prompts 5 --block-sizes 8 16
    python -m sgl_dflash.bench --prompts-file my_prompts.jsonl   # {"prompt": ...} per line

Per dataset and block size: tau (mean accepted length per draft/verify cycle = 1 + accepted
drafts), per-position acceptance (fraction of cycles whose k-th draft was accepted), tokens/s of
DFLASH and of NONE (one request at a time, greedy, chat template) and their ratio, and the number
of prompts whose DFLASH output equals the NONE output token for token. The peer comparison runs
z-lab's reference `dflash_generate` (transformers target on the same converted weights, same
drafter) on a few prompts: its tau next to ours, and tokens/s ours / theirs.

Writes <out>/bench.json and PNG plots (per-position acceptance, speedup, c(K)).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from sgl_dflash import tools
from sgl_dflash.tools import datasets
from sgl_dflash.tools.demo import DEFAULT_DRAFTER


class BenchError(ValueError):
    """Bad benchmark arguments; the message names the flag."""


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def count_exact(outputs_a: Sequence[Sequence[int]], outputs_b: Sequence[Sequence[int]]) -> int:
    """How many prompts produced identical token sequences in both runs."""
    if len(outputs_a) != len(outputs_b):
        raise BenchError(f"cannot compare {len(outputs_a)} outputs with {len(outputs_b)}")
    return sum(list(a) == list(b) for a, b in zip(outputs_a, outputs_b))


def acceptance_stats(histograms: Sequence[Sequence[int]]) -> dict:
    """From per-request histograms of accepted drafts per cycle (index = number accepted):
    tau = 1 + mean accepted, per_position[k-1] = P(draft k accepted), c_curve[K-1] = expected
    tau had the block been K tokens long (1 + sum_{k<K} P(accepted >= k))."""
    width = max((len(h) for h in histograms), default=0)
    total = np.zeros(width, dtype=np.int64)
    for h in histograms:
        total[: len(h)] += np.asarray(h, dtype=np.int64)
    cycles = int(total.sum())
    if cycles == 0:
        return {"tau": float("nan"), "cycles": 0, "per_position": [], "c_curve": [], "histogram": total.tolist()}
    at_least = total[::-1].cumsum()[::-1] / cycles  # at_least[k] = P(accepted >= k)
    per_position = at_least[1:].tolist()
    return {
        "tau": float(1 + (np.arange(width) * total).sum() / cycles),
        "cycles": cycles,
        "per_position": per_position,
        "c_curve": [float(1 + sum(per_position[: k - 1])) for k in range(1, width + 1)],
        "histogram": total.tolist(),
    }


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    outputs: list[list[int]]
    seconds: float
    tokens: int
    histograms: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def run_engine(engine, prompts: list[list[int]], max_new_tokens: int, desc: str) -> Run:
    """One request at a time (latency-bound decoding, as speculative decoding is meant for)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    outputs, hists, seconds = [], [], 0.0
    for ids in tqdm(prompts, desc=desc, unit="prompt", leave=False):
        start = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params=params)
        seconds += time.perf_counter() - start
        outputs.append(list(out["output_ids"]))
        hists.append(list(out["meta_info"].get("spec_correct_drafts_histogram", [])))
    return Run(outputs, seconds, sum(len(o) for o in outputs), hists)


def make_engine(target_dir: str, draft_dir: str | None, block_size: int | None, max_len: int,
                token_map: str | None = None):
    from sgl_dflash.entrypoints.engine import Engine

    kwargs = dict(model_path=str(target_dir), skip_tokenizer_init=True, dtype="float32",
                  max_running_requests=1, max_total_tokens=max_len + 64, random_seed=0)
    if draft_dir is not None:
        kwargs.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft_dir),
                      speculative_num_draft_tokens=block_size, speculative_token_map=token_map)
    return Engine(**kwargs)


def reference_run(target_dir: str, draft_dir: str, prompts: list[list[int]], max_new_tokens: int,
                  block_size: int, eos_ids: Sequence[int]) -> Run:
    """z-lab's `dflash_generate` (torch eager, transformers target) on the same weights."""
    import dflash.model as zlab
    import torch
    from transformers import AutoModelForCausalLM

    zlab._cuda_time = time.perf_counter  # its stats timer synchronizes CUDA; this may be a CPU box
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = zlab.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    outputs, hists, seconds = [], [], 0.0
    for ids in tqdm(prompts, desc="z-lab reference", unit="prompt", leave=False):
        start = time.perf_counter()
        stats = zlab.dflash_generate(draft, target, torch.tensor([ids]), max_new_tokens, list(eos_ids),
                                     block_size=block_size, return_stats=True)
        seconds += time.perf_counter() - start
        outputs.append(stats.output_ids[0, len(ids):].tolist())
        hist = [0] * block_size
        for produced in stats.acceptance_lengths:
            hist[min(produced, block_size) - 1] += 1
        hists.append(hist)
    return Run(outputs, seconds, sum(len(o) for o in outputs), hists)


# ----------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------


def load_prompt_sets(names: Sequence[str], prompts_file: str | None, num_prompts: int) -> dict[str, list[dict]]:
    sets = {name: datasets.load_benchmark(name)[:num_prompts] for name in names}
    if prompts_file:
        sets[Path(prompts_file).stem] = datasets.read_jsonl(prompts_file)[:num_prompts]
    if not sets:
        raise BenchError("nothing to run: pass --datasets and/or --prompts-file")
    return sets


def machine_description() -> dict:
    import jax

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "jax_backend": jax.default_backend(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def run_bench(
    target_dir: str,
    draft_dir: str,
    prompt_sets: dict[str, list[dict]],
    *,
    block_sizes: Sequence[int] = (4, 8, 16),
    max_new_tokens: int = 256,
    peer_prompts: int = 3,
    peer_block_size: int | None = None,
    progress: bool = True,
    token_map: str | None = None,
) -> dict:
    from transformers import AutoTokenizer

    from sgl_dflash.model_config import eos_token_ids
    from sgl_dflash.tools.train.regenerate import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenized = {name: [chat_prompt_ids(tokenizer, row["prompt"]) for row in rows] for name, rows in prompt_sets.items()}
    max_len = max(len(ids) for rows in tokenized.values() for ids in rows) + max_new_tokens + max(block_sizes)
    warm = [max((ids for rows in tokenized.values() for ids in rows), key=len)]

    results: dict = {"target": str(target_dir), "draft": str(draft_dir), "token_map": token_map,
                     "max_new_tokens": max_new_tokens,
                     "block_sizes": list(block_sizes), "machine": machine_description(), "datasets": {}}
    engine = make_engine(target_dir, None, None, max_len)
    run_engine(engine, warm, max_new_tokens, "warmup NONE")
    baseline = {name: run_engine(engine, rows, max_new_tokens, f"NONE {name}") for name, rows in tokenized.items()}
    engine.shutdown()
    for name, run in baseline.items():
        results["datasets"][name] = {"num_prompts": len(run.outputs), "none": {
            "tokens": run.tokens, "seconds": run.seconds, "tokens_per_s": run.tokens_per_s}, "dflash": {}}

    ours_for_peer = None
    peer_block = peer_block_size or max(block_sizes)
    for block in block_sizes:
        engine = make_engine(target_dir, draft_dir, block, max_len, token_map)
        results["token_map"] = engine.server_args.speculative_token_map  # the drafter's own when not given
        run_engine(engine, warm, max_new_tokens, f"warmup DFLASH B={block}")
        for name, rows in tokenized.items():
            run = run_engine(engine, rows, max_new_tokens, f"DFLASH B={block} {name}")
            base = baseline[name]
            results["datasets"][name]["dflash"][str(block)] = {
                **acceptance_stats(run.histograms),
                "tokens": run.tokens, "seconds": run.seconds, "tokens_per_s": run.tokens_per_s,
                "speedup": run.tokens_per_s / base.tokens_per_s,
                "exact": count_exact(run.outputs, base.outputs), "num_prompts": len(rows),
            }
        if block == peer_block and peer_prompts > 0:
            peer_ids = _peer_prompt_ids(tokenized, peer_prompts)
            ours_for_peer = run_engine(engine, peer_ids, max_new_tokens, "ours (peer prompts)")
        engine.shutdown()

    if ours_for_peer is not None:
        peer_ids = _peer_prompt_ids(tokenized, peer_prompts)
        eos = sorted(eos_token_ids(str(target_dir), tokenizer))
        theirs = reference_run(target_dir, draft_dir, peer_ids, max_new_tokens, peer_block, eos)
        ours_stats, their_stats = acceptance_stats(ours_for_peer.histograms), acceptance_stats(theirs.histograms)
        results["peer"] = {
            "reference": "z-lab dflash==0.1.0 dflash_generate, transformers target (fp32, torch eager)",
            "block_size": peer_block, "num_prompts": len(peer_ids),
            "ours": {"tau": ours_stats["tau"], "tokens_per_s": ours_for_peer.tokens_per_s},
            "reference_run": {"tau": their_stats["tau"], "tokens_per_s": theirs.tokens_per_s},
            "tokens_per_s_ratio": ours_for_peer.tokens_per_s / theirs.tokens_per_s,
            "exact_vs_reference": count_exact(ours_for_peer.outputs, theirs.outputs),
        }
    results["summary"] = summarize(results)
    return results


def _peer_prompt_ids(tokenized: dict[str, list[list[int]]], n: int) -> list[list[int]]:
    """The first prompt of each set, round-robin, until n."""
    rows, i = [], 0
    while len(rows) < n and any(i < len(r) for r in tokenized.values()):
        rows += [r[i] for r in tokenized.values() if i < len(r)]
        i += 1
    return rows[:n]


def summarize(results: dict) -> dict:
    """Averages the goals are stated in: tau over the four reasoning/code sets, best speedup."""
    core_sets = [n for n in ("gsm8k", "math500", "humaneval", "mbpp") if n in results["datasets"]]
    summary = {}
    for block in results["block_sizes"]:
        rows = [results["datasets"][n]["dflash"][str(block)] for n in results["datasets"]]
        core = [results["datasets"][n]["dflash"][str(block)] for n in core_sets]
        summary[str(block)] = {
            "tau_avg_core4": float(np.mean([r["tau"] for r in core])) if core else None,
            "speedup_avg": float(np.mean([r["speedup"] for r in rows])),
            "exact": int(sum(r["exact"] for r in rows)), "num_prompts": int(sum(r["num_prompts"] for r in rows)),
        }
    best = max(summary, key=lambda b: summary[b]["speedup_avg"])
    summary["best_block_size"] = int(best)
    return summary


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["datasets"])
    blocks = [str(b) for b in results["block_sizes"]]
    largest = blocks[-1]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        per_pos = results["datasets"][name]["dflash"][largest]["per_position"]
        ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=name)
    ax.set(xlabel="draft position k", ylabel="P(draft k accepted)", ylim=(0, 1),
           title=f"Per-position acceptance (block {largest})")
    ax.legend()
    paths.append(_save(fig, out_dir / "acceptance_per_position.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(blocks)
    for j, block in enumerate(blocks):
        ax.bar(np.arange(len(names)) + j * width, [results["datasets"][n]["dflash"][block]["speedup"] for n in names],
               width, label=f"B={block}")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(np.arange(len(names)) + width * (len(blocks) - 1) / 2, names)
    ax.set(ylabel="DFLASH / NONE tokens/s", title="Speedup per dataset")
    ax.legend()
    paths.append(_save(fig, out_dir / "speedup.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        curve = results["datasets"][name]["dflash"][largest]["c_curve"]
        ax.plot(range(1, len(curve) + 1), curve, marker=".", label=name)
    ax.set(xlabel="block size K", ylabel="c(K) = expected accepted length",
           title=f"c(K) from block-{largest} acceptance")
    ax.legend()
    paths.append(_save(fig, out_dir / "c_curve.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def format_table(results: dict) -> str:
    lines = ["| dataset | B | tau | DFLASH tok/s | NONE tok/s | speedup | exact |", "|---|---|---|---|---|---|---|"]
    for name, row in results["datasets"].items():
        for block, r in row["dflash"].items():
            lines.append(f"| {name} | {block} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                         f"{row['none']['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['exact']}/{r['num_prompts']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from sgl_dflash.tools import model_import

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="target HF dir (default: converted SmolLM2-135M)")
    parser.add_argument("--draft-model-path", default=None, help=f"drafter (default: {DEFAULT_DRAFTER})")
    parser.add_argument("--datasets", nargs="*", default=list(datasets.BENCH_DATASETS),
                        help=f"subset of {', '.join(datasets.BENCH_DATASETS)} (none: only --prompts-file)")
    parser.add_argument("--prompts-file", default=None, help='JSONL with a "prompt" per line')
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--peer-prompts", type=int, default=3, help="prompts for the z-lab comparison (0: skip)")
    parser.add_argument("--speculative-token-map", default=None, help=tools.TOKEN_MAP_HELP)
    parser.add_argument("--out", type=Path, default=tools.REPO_ROOT / "bench_results")
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if any(b < 2 for b in args.block_sizes):
        raise BenchError(f"--block-sizes must all be >= 2, got {args.block_sizes}")
    unknown = set(args.datasets) - set(datasets.BENCH_DATASETS)
    if unknown:
        raise BenchError(f"--datasets: unknown {sorted(unknown)}; choose from {', '.join(datasets.BENCH_DATASETS)}")

    target = args.model_path or str(model_import.ensure_default_model())
    draft = args.draft_model_path or str(DEFAULT_DRAFTER)
    sets = load_prompt_sets(args.datasets, args.prompts_file, args.num_prompts)
    results = run_bench(target, draft, sets, block_sizes=sorted(args.block_sizes),
                        max_new_tokens=args.max_new_tokens, peer_prompts=args.peer_prompts,
                        token_map=args.speculative_token_map)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    plots = plot(results, args.out)
    print(format_table(results))
    print(json.dumps({"summary": results["summary"], "peer": results.get("peer")}, indent=2))
    print("wrote", args.out / "bench.json", *plots)
    return results


if __name__ == "__main__":
    main()
