"""Interleaved A/B of two adaptive-policy settings against NONE, in one process (issue 14).

    .venv/bin/python scripts/ab_adaptive_policy.py --batch-size 8 --num-prompts 32 \
        --datasets gsm8k mt-bench --old min_gain=0 probe_slack=1 [--out bench_results/ab_adaptive.json]

Three engines (NONE, adaptive with the policy's settings changed by --old, adaptive with its
defaults) serve the same unseen prompts, greedy, `--batch-size` at a time through
`Engine.generate`, taking turns per batch with the first one rotating, so that a shared machine's
load hits them alike (on 2 shared cores a whole-pass comparison moves 20-30% between runs). Each
set is served twice: pass 0 includes compiles and learning, pass 1 is a warm server. Prints and
writes tokens/s per engine, the ratios to NONE, drafted steps, and whether every output equals
NONE's (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.speculative.adaptive import AdaptivePolicy
from sgl_dflash.tools import datasets, model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, chat_prompts, use_compilation_cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="default: the converted SmolLM2-135M-Instruct")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "mt-bench"])
    parser.add_argument("--old", nargs="*", default=["min_gain=0", "probe_slack=1"],
                        help="AdaptivePolicy settings (its constructor's arguments) of the 'old' engine, name=value")
    parser.add_argument("--out", default="bench_results/ab_adaptive.json")
    args = parser.parse_args(argv)
    old_settings = parse_settings(parser, args.old)

    use_compilation_cache()
    if args.model_path is None:
        args.model_path = str(model_import.ensure_default_model())
    spec = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
                speculative_token_map=str(DEFAULT_DRAFTER / "token_map.json"),
                speculative_num_draft_tokens=16, speculative_adaptive=True)
    engines = {"NONE": Engine(model_path=args.model_path, random_seed=0),
               "old": Engine(model_path=args.model_path, random_seed=0, **spec),
               "new": Engine(model_path=args.model_path, random_seed=0, **spec)}
    for name, value in old_settings.items():
        setattr(engines["old"].scheduler.worker.policy, name, value)

    params = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    names, rows, exact = list(engines), [], True
    for dataset in args.datasets:
        texts = [r["prompt"] for r in datasets.load_benchmark(dataset)[: args.num_prompts]]
        prompts = chat_prompts(engines["NONE"].tokenizer, texts)
        for run in range(2):
            seconds, tokens, outputs = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {k: [] for k in names}
            drafted_before = {k: engines[k].scheduler.worker.timings.get("drafted_steps", 0) for k in ("old", "new")}
            for turn, start in enumerate(range(0, len(prompts), args.batch_size)):
                for name in names[turn % 3:] + names[: turn % 3]:
                    t = time.perf_counter()
                    outs = engines[name].generate(prompt=prompts[start : start + args.batch_size], sampling_params=params)
                    seconds[name] += time.perf_counter() - t
                    outputs[name] += [o["output_ids"] for o in outs]
                    tokens[name] += sum(o["meta_info"]["completion_tokens"] for o in outs)
            rate = {k: tokens[k] / seconds[k] for k in names}
            row = {"dataset": dataset, "batch_size": args.batch_size, "pass": run,
                   "tokens_per_s": rate, "vs_none": {k: rate[k] / rate["NONE"] for k in names},
                   "drafted_steps": {k: engines[k].scheduler.worker.timings.get("drafted_steps", 0) - drafted_before[k]
                                     for k in ("old", "new")},
                   "exact": all(outputs[k] == outputs["NONE"] for k in names)}
            exact &= row["exact"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"old": args.old, "num_prompts": args.num_prompts,
                                          "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=1))
    return 0 if exact else 1


def parse_settings(parser: argparse.ArgumentParser, settings: list[str]) -> dict[str, float | int]:
    """name=value pairs naming numeric arguments of AdaptivePolicy (checked before any model loads)."""
    defaults = {name: p.default for name, p in inspect.signature(AdaptivePolicy).parameters.items()
                if isinstance(p.default, (int, float)) and not isinstance(p.default, bool)}
    parsed = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name not in defaults:
            parser.error(f"--old {setting!r}: not a numeric AdaptivePolicy setting; one of {sorted(defaults)}")
        try:
            parsed[name] = type(defaults[name])(float(value))
        except ValueError:
            parser.error(f"--old {setting!r}: {value!r} is not a number")
    return parsed


if __name__ == "__main__":
    sys.exit(main())
