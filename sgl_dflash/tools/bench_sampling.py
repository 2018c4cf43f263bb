"""The cost of top-k / top-p sampling: the candidate path against the whole-vocabulary sort, and
what sampling costs an engine's decode.

    python -m sgl_dflash.tools.bench_sampling
    python -m sgl_dflash.tools.bench_sampling --rows 1 8 32 64 --engine-batch 32 --max-new-tokens 64

1. The transform alone (`jax_backend.sampling`, the real vocabulary, one process, interleaved):
   `_filtered_probs` (top-k/top-p from the `NUM_CANDIDATES` best, the sort only when a row keeps
   more) against `_sorted_probs` (every row's vocabulary sorted, the transform before 2026-11-28)
   and `_plain_probs` (no top-k/top-p), for "peaked" rows (logits ~ N(0, 4^2): a nucleus of a
   few tokens, as a language model's) and "flat" rows (N(0, 0.1^2): a nucleus of most of the
   vocabulary, so the candidate path falls back to the sort), temperature 0.8, top-p 0.95.
2. The engine (the real target, NONE, engine defaults): one batch of chat prompts (MT-Bench, chat
   template) generated greedy, sampled (temperature 0.8), and sampled with top-p 0.95, EOS
   ignored, the three taking turns, repeated; tokens per second of each call (prefill included).

Writes <out>/sampling.json and <out>/sampling.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jax_backend import sampling
from sgl_dflash import tools

TEMPERATURE, TOP_P = 0.8, 0.95


@jax.jit
def _sorted(logits, temperature, top_p, top_k):
    """The whole-vocabulary transform, as `_filtered_probs` runs it when it falls back."""
    return sampling._sorted_probs(*sampling.filter_inputs(logits, temperature, top_p, top_k))


def _seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def transform_rows(rows: list[int], vocab: int, repeats: int) -> list[dict]:
    """Median ms of each transform per (rows, distribution), the three interleaved."""
    out = []
    rng = np.random.default_rng(0)
    for n in tqdm(rows, desc="transform"):
        for kind, scale in (("peaked", 4.0), ("flat", 0.1)):
            logits = jnp.asarray(rng.standard_normal((n, vocab)).astype(np.float32) * scale)
            args = (logits, jnp.full(n, TEMPERATURE), jnp.full(n, TOP_P), jnp.zeros(n, jnp.int32))
            fns = {"candidates": sampling._filtered_probs, "sorted": _sorted,
                   "plain": lambda x, t, p, k: sampling._plain_probs(x, t)}
            np.testing.assert_allclose(np.asarray(fns["candidates"](*args)), np.asarray(fns["sorted"](*args)),
                                       atol=1e-6, rtol=0)  # the same distribution, or no timing
            for fn in fns.values():  # compiled before the clock runs
                jax.block_until_ready(fn(*args))
            times = {name: [] for name in fns}
            for _ in range(repeats):
                for name, fn in fns.items():
                    times[name].append(_seconds(fn, *args))
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            out.append({"rows": n, "logits": kind, "ms": ms, "sorted/candidates": ms["sorted"] / ms["candidates"]})
    return out


def engine_rows(args) -> dict:
    """Tokens/s of one NONE engine's calls over the same batch: greedy, sampled, sampled + top-p."""
    from sgl_dflash.entrypoints.engine import Engine
    from sgl_dflash.tools import model_import
    from sgl_dflash.tools.bench_concurrency import take_prompts
    from sgl_dflash.tools.train.regenerate import chat_prompt_ids

    engine = Engine(model_path=str(model_import.ensure_default_model()), random_seed=0)
    texts, _ = take_prompts("mt-bench", args.engine_batch)
    prompts = [chat_prompt_ids(engine.tokenizer, p) for p in texts]
    modes = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": TEMPERATURE},
             "sampled, top-p": {"temperature": TEMPERATURE, "top_p": TOP_P}}
    for params in modes.values():  # a first pass compiles each mode's programs
        engine.generate(input_ids=prompts, sampling_params=dict(params, max_new_tokens=4, ignore_eos=True))
    runs = {name: [] for name in modes}
    for _ in tqdm(range(args.engine_repeats), desc="engine"):
        for name, params in modes.items():
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=dict(
                params, max_new_tokens=args.max_new_tokens, ignore_eos=True))
            runs[name].append(sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start))
    engine.shutdown()
    rates = {name: statistics.median(r) for name, r in runs.items()}
    return {"batch": args.engine_batch, "max_new_tokens": args.max_new_tokens, "tokens_per_s": rates,
            "per_repeat": runs, "top-p/sampled": rates["sampled, top-p"] / rates["sampled"]}


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, style in (("peaked", "-"), ("flat", ":")):
        rows = [r for r in results["transform"] if r["logits"] == kind]
        for name in ("candidates", "sorted", "plain"):
            axes[0].plot([r["rows"] for r in rows], [r["ms"][name] for r in rows], style, marker="o",
                         label=f"{name} ({kind})")
    axes[0].set(xscale="log", yscale="log", xlabel="rows", ylabel="ms (median)",
                title=f"top-p {TOP_P} transform, V={results['vocab']}")
    axes[0].legend(fontsize=7)
    engine = results.get("engine")
    if engine:
        names = list(engine["tokens_per_s"])
        axes[1].bar(names, [engine["tokens_per_s"][n] for n in names])
        axes[1].set(ylabel="tokens/s per call (median)", title=f"NONE engine, batch {engine['batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine-batch", type=int, default=32, help="0: skip the engine part")
    parser.add_argument("--engine-repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=tools.REPO_ROOT / "bench_results")
    args = parser.parse_args(argv)
    results = {"config": vars(args) | {"out": str(args.out)}, "vocab": args.vocab,
               "num_candidates": sampling.NUM_CANDIDATES, "backend": jax.default_backend(),
               "transform": transform_rows(args.rows, args.vocab, args.repeats)}
    for r in results["transform"]:
        print(f"rows {r['rows']:3d} {r['logits']:6s}: " + " ".join(f"{k} {v:.1f} ms" for k, v in r["ms"].items())
              + f" | sorted/candidates {r['sorted/candidates']:.1f}x")
    if args.engine_batch:
        results["engine"] = engine_rows(args)
        print("engine tokens/s:", {k: round(v, 1) for k, v in results["engine"]["tokens_per_s"].items()})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sampling.json"
    path.write_text(json.dumps(results, indent=1))
    print("wrote", path, plot(results, args.out / "sampling.png"))
    return results


if __name__ == "__main__":
    main()
