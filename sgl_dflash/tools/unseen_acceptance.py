"""A drafter's acceptance on prompts it never trained on, per draft position, written into its
config.json as the adaptive policy's prior.

    python -m sgl_dflash.tools.unseen_acceptance            # measure, write JSON + PNG to --out
    python -m sgl_dflash.tools.unseen_acceptance --write    # and record it in the drafter's config

`--speculative-adaptive` decides whether a joining request gets drafter context from what a
typical request's drafts would gain at that load; until it has read drafts of its own, it takes
the drafter's acceptance from its config. Training records it on held-out responses to the
training prompts (`training.held_out`), which overstates what users' prompts accept: for the
project's drafter 0.80 / 0.76 / 0.74 at positions 1-3 against 0.55-0.67 / 0.41-0.59 / 0.46-0.55
on MT-Bench and GSM8K (docs/adaptive.md, 2026-12-07), enough to let a fresh engine give a batch of
8 drafter context where no draft pays on a 2-core CPU. This tool serves benchmark prompts from the
END of each set (the benchmarks take theirs from the start) through a fixed-block DFLASH engine,
greedy, every draft verified, and reads each step's accepted drafts from the engine's own
histogram (`spec_correct_drafts_histogram`). `--write` stores the rates as
`training.unseen.B<b>` (the same form as `training.held_out.B<b>`: the fraction of steps that
accepted at least i drafts), which `DFlashConfig.prior_acceptance` prefers.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np

from sgl_dflash import tools

SOURCES = ("gsm8k", "mt-bench", "math500", "mt-bench")  # bench_concurrency's "mixed" set, in turn


def rates_from_histogram(histogram: list[int] | np.ndarray) -> np.ndarray:
    """[P] the fraction of verify steps that accepted at least i drafts (i = 1 .. P), from a count
    of steps per accepted drafts 0 .. P."""
    counts = np.asarray(histogram, np.float64)
    if counts.ndim != 1 or counts.size < 2 or counts.sum() <= 0:
        raise ValueError("a histogram of accepted drafts needs positions 0 .. P and at least one step")
    at_least = np.cumsum(counts[::-1])[::-1]  # at_least[i]: steps with >= i accepted
    return at_least[1:] / counts.sum()


def end_rows(count: int) -> dict[str, list[str]]:
    """`count` prompts taken in turn from SOURCES, each source's from its last rows."""
    from sgl_dflash.tools import datasets

    per_source = collections.Counter(SOURCES[i % len(SOURCES)] for i in range(count))
    prompts = {}
    for name, n in per_source.items():
        rows = datasets.load_benchmark(name)
        prompts[name] = [r["prompt"] for r in rows[max(0, len(rows) - n):]]
    return prompts


def measure(engine, prompts: dict[str, list[list[int]]], max_new_tokens: int) -> dict:
    """Each set's prompts (token ids) served at once, greedy: per set and pooled, the steps'
    histogram of accepted drafts, the rates (`rates_from_histogram`) and tau (tokens per step)."""
    results, pooled = {}, None
    for name, ids in prompts.items():
        outs = engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens})
        histogram = np.sum([o["meta_info"]["spec_correct_drafts_histogram"] for o in outs], axis=0)
        pooled = histogram if pooled is None else pooled + histogram
        results[name] = _summary(histogram, len(ids))
    results["all"] = _summary(pooled, sum(len(ids) for ids in prompts.values()))
    return results


def _summary(histogram: np.ndarray, prompts: int) -> dict:
    rates = rates_from_histogram(histogram)
    return {"prompts": prompts, "steps": int(histogram.sum()), "histogram": histogram.tolist(),
            "accept_rate_per_position": rates.tolist(), "tau": float(1 + rates.sum())}


def write_prior(draft_dir: Path, block_size: int, measured: dict, note: dict) -> Path:
    """Records the pooled rates as `training.unseen.B<block_size>` in the drafter's config.json."""
    path = Path(draft_dir) / "config.json"
    config = json.loads(path.read_text())
    unseen = config.setdefault("training", {}).setdefault("unseen", {})
    unseen[f"B{block_size}"] = {k: measured["all"][k] for k in ("accept_rate_per_position", "tau", "steps", "prompts")}
    unseen[f"B{block_size}"]["how"] = note
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def plot(results: dict, held_out: list[float] | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        rates = r["accept_rate_per_position"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", lw=2.5 if name == "all" else 1,
                label=f"{name} (tau {r['tau']:.2f}, {r['steps']} steps)")
    if held_out:
        ax.plot(range(1, len(held_out) + 1), held_out, "k--", label="training's held-out responses")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("steps accepting >= i drafts")
    ax.set_title("Drafter acceptance on unseen benchmark prompts (greedy, fixed block)")
    ax.legend(fontsize=7)
    return tools.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from sgl_dflash.entrypoints.engine import Engine
    from sgl_dflash.tools import model_import
    from sgl_dflash.tools.bench_concurrency import save
    from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
    from sgl_dflash.tools.train.regenerate import chat_prompt_ids
    from torchax_proposer.config import DFlashConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="target HF dir (default: converted SmolLM2-135M)")
    parser.add_argument("--draft-model-path", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--block-size", type=int, default=None, help="default: the drafter's own block")
    parser.add_argument("--prompts", type=int, default=48, help="prompts in all, taken in turn from " + ", ".join(SOURCES))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--write", action="store_true", help="record the rates in the drafter's config.json")
    parser.add_argument("--compilation-cache", type=Path, default=tools.CACHE_DIR / "jax_compilation_cache")
    parser.add_argument("--out", type=Path, default=tools.REPO_ROOT / "bench_results")
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error("--prompts must be >= 1")
    use_compilation_cache(args.compilation_cache)
    config = DFlashConfig.from_pretrained(args.draft_model_path)
    block = args.block_size or config.block_size
    if not 2 <= block <= config.block_size:
        parser.error(f"--block-size must be in 2 .. {config.block_size} (the drafter's block)")
    model_path = args.model_path or str(model_import.ensure_default_model())
    engine = Engine(model_path=model_path, speculative_algorithm="DFLASH", random_seed=0,
                    speculative_draft_model_path=str(args.draft_model_path), speculative_num_draft_tokens=block)
    prompts = end_rows(args.prompts)
    measured = measure(engine, {name: [chat_prompt_ids(engine.tokenizer, t) for t in texts]
                                for name, texts in prompts.items()}, args.max_new_tokens)
    engine.shutdown()
    held = config.raw.get("training", {}).get("held_out", {}).get(f"B{block}", {}).get("accept_rate_per_position")
    results = {"config": vars(args) | {"block_size": block}, "held_out": held, "sets": measured}
    path = save(results, args.out, "unseen_acceptance.json")
    png = plot(measured, held, args.out / "unseen_acceptance.png")
    for name, r in measured.items():
        print(f"{name:9s} prompts {r['prompts']:3d} steps {r['steps']:5d} tau {r['tau']:.2f} rates {r['accept_rate_per_position']}")
    if args.write:
        note = {"sources": {name: f"last {len(p)} rows" for name, p in prompts.items()}, "greedy": True,
                "max_new_tokens": args.max_new_tokens, "target": Path(model_path).name,
                "tool": "python -m sgl_dflash.tools.unseen_acceptance --write"}
        print("wrote", write_prior(args.draft_model_path, block, measured, note))
    print("wrote", path, png)
    return results


if __name__ == "__main__":
    main()
