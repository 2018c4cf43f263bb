"""The adaptive engine's plain step against NONE's decode step, pair by pair.

    python -m sgl_dflash.tools.bench_plain_step [--batch-sizes 1 8 32] [--steps 200]

On a prompt set where no draft pays (MT-Bench on this project's CPU), `--speculative-adaptive`
runs plain decode steps, and what it reads there against NONE is the price of staying ready to
draft: the policy's plan and learning, the drafter's commit of every step's features, the
worker's bookkeeping (docs/adaptive.md, "the plain floor"). The closed-loop bench
(`bench_concurrency`) sees that only through passes that move by a few percent on their own; this
bench pairs single steps. A NONE engine and an adaptive engine whose policy never drafts (no
probes, no exploration) each hold the same n requests (MT-Bench prompts, chat template, EOS
ignored), and take decode steps in turn, the order alternating, so both steps of a pair meet the
same machine. Per batch size it reports the median step of each, the median of the pairs'
ratios, and the adaptive step's parts from the worker's own clock (the plan before the device
step, the device step with the commit and the learning, the rest), and checks that both engines
generated the same tokens. Writes <out>/plain_step.json and <out>/plain_step.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sgl_dflash import tools

PARTS = ("plan", "device step, commit, learning", "rest")


def force_plain(engine) -> None:
    """The adaptive engine's policy never drafts: no probes, no exploration, no refresh, and a
    draft would have to gain 10x. Its steps are then plain steps with all their upkeep."""
    policy = engine.scheduler.worker.policy
    policy.probe_every, policy.explore_every, policy.min_gain, policy.refresh_every = 10**9, 0, 10.0, 0


def measure(engines: dict, prompts: list[list[int]], steps: int, warmup: int = 10) -> dict:
    """engines: {"NONE": ..., "adaptive": ...} (adaptive forced plain). Each serves `prompts` at
    once; after `warmup` decode steps they take `steps` decode steps in turn. Returns the pairs'
    step times (ms), the adaptive parts per step and whether the outputs agree."""
    from sgl_dflash.managers.schedule_batch import Req, new_rid
    from sgl_dflash.sampling_params import SamplingParams

    params = dict(temperature=0.0, max_new_tokens=warmup + steps + 1, ignore_eos=True)
    reqs = {name: [Req(new_rid(), list(p), SamplingParams(**params)) for p in prompts] for name in engines}
    for name, engine in engines.items():
        for req in reqs[name]:
            engine.scheduler.add_request(req)
        while engine.scheduler.waiting:  # the prefills
            engine.scheduler.step()
        start = engine.scheduler.stats["decode_steps"]
        while engine.scheduler.stats["decode_steps"] < start + warmup:  # compiles, warm caches
            engine.scheduler.step()
    worker = engines["adaptive"].scheduler.worker
    times = {name: [] for name in engines}
    parts = []
    names = list(engines)
    for i in tqdm(range(steps), desc=f"plain steps, batch {len(prompts)}", leave=False):
        for name in names if i % 2 == 0 else names[::-1]:
            before = dict(worker.timings)
            clock = time.perf_counter()
            engines[name].scheduler.step()
            seconds = time.perf_counter() - clock
            times[name].append(seconds * 1e3)
            if name == "adaptive":
                plan, device = (worker.timings[k] - before.get(k, 0.0) for k in ("draft", "verify"))
                parts.append([plan * 1e3, device * 1e3, (seconds - plan - device) * 1e3])
    for engine in engines.values():
        while engine.scheduler.has_work():
            engine.scheduler.step()
    outputs = {name: [list(r.output_ids) for r in reqs[name]] for name in engines}
    return {"times": times, "parts": parts, "exact": outputs["adaptive"] == outputs["NONE"]}


def summarize(batch: int, measured: dict) -> dict:
    none, adaptive = (np.asarray(measured["times"][k]) for k in ("NONE", "adaptive"))
    return {"batch": batch, "steps": len(none), "exact": measured["exact"],
            "none_ms": float(np.median(none)), "adaptive_ms": float(np.median(adaptive)),
            "adaptive_over_none": float(np.median(adaptive / none)),
            "adaptive_parts_ms": dict(zip(PARTS, np.median(np.asarray(measured["parts"]), axis=0).round(3).tolist()))}


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["none_ms"] for r in rows], 0.4, label="NONE step", color="0.6")
    bottom = np.zeros(len(rows))
    for part in PARTS:
        values = np.array([r["adaptive_parts_ms"][part] for r in rows])
        ax.bar(x + 0.2, values, 0.4, bottom=bottom, label=f"adaptive: {part}")
        bottom += values
    for xi, r in zip(x, rows):
        ax.annotate(f"{r['adaptive_over_none']:.3f}x", (xi + 0.2, max(r["adaptive_ms"], bottom[xi])), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("ms per decode step (medians)")
    ax.set_title("Adaptive plain step vs NONE (pairs' median ratio above)")
    ax.legend(fontsize=7)
    return tools.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from sgl_dflash.entrypoints.engine import Engine
    from sgl_dflash.tools import model_import
    from sgl_dflash.tools.bench_concurrency import prompt_sets
    from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
    from sgl_dflash.tools.train.regenerate import chat_prompt_ids

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="target HF dir (default: converted SmolLM2-135M)")
    parser.add_argument("--draft-model-path", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=200, help="decode steps per engine and batch size")
    parser.add_argument("--compilation-cache", type=Path, default=tools.CACHE_DIR / "jax_compilation_cache")
    parser.add_argument("--out", type=Path, default=tools.REPO_ROOT / "bench_results")
    args = parser.parse_args(argv)
    use_compilation_cache(args.compilation_cache)
    common = dict(model_path=args.model_path or str(model_import.ensure_default_model()), random_seed=0)
    engines = {"NONE": Engine(**common),
               "adaptive": Engine(**common, speculative_algorithm="DFLASH", speculative_adaptive=True,
                                  speculative_draft_model_path=args.draft_model_path, speculative_num_draft_tokens=16)}
    force_plain(engines["adaptive"])
    chat = prompt_sets(["mt-bench"], max(args.batch_sizes))["mt-bench"]
    prompts = [chat_prompt_ids(engines["NONE"].tokenizer, p) for p in chat]
    rows = []
    for batch in args.batch_sizes:
        rows.append(summarize(batch, measure(engines, prompts[:batch], args.steps)))
        r = rows[-1]
        print(f"batch {batch}: NONE {r['none_ms']:.2f} ms, adaptive {r['adaptive_ms']:.2f} ms, pairs' median "
              f"{r['adaptive_over_none']:.4f}x, parts {r['adaptive_parts_ms']}, exact {r['exact']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    (args.out / "plain_step.json").write_text(json.dumps(results, indent=1))
    plot(rows, args.out / "plain_step.png")
    if not all(r["exact"] for r in rows):
        raise SystemExit("adaptive's outputs differ from NONE's")
    return results


if __name__ == "__main__":
    main()
