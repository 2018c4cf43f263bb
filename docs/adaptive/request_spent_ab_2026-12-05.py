"""A/B of the per-request context rule (`RealizedGains.spent`, docs/adaptive.md 2026-12-05 evening):
NONE, the adaptive engine as it is, and one without the rule (min_request_steps never reached), in
one process, serving the same batches in turn (`bench_batches.run_batches`):

    python docs/adaptive/request_spent_ab_2026-12-05.py OUT.json "mt-bench:1x8" "gsm8k:1x6" "mixed:1,8,32x2"

A spec is set:batch sizes x repeats."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.speculative.realized import RealizedGains
from sgl_dflash.tools import CACHE_DIR
from sgl_dflash.tools.bench_batches import format_rows, run_batches, summarize
from sgl_dflash.tools.bench_concurrency import _machine, take_prompts
from sgl_dflash.tools.bench_engines import resolve_engine_args
from sgl_dflash.tools.train.regenerate import chat_prompt_ids

args = SimpleNamespace(model_path=None, draft_model_path=None, compilation_cache=CACHE_DIR / "jax_compilation_cache")
resolve_engine_args(args)
spec = dict(model_path=args.model_path, random_seed=0, speculative_algorithm="DFLASH",
            speculative_draft_model_path=args.draft_model_path, speculative_num_draft_tokens=16,
            speculative_adaptive=True)
engines = {"NONE": Engine(model_path=args.model_path, random_seed=0), "adaptive": Engine(**spec),
           "adaptive_no_rule": Engine(**spec)}
engines["adaptive_no_rule"].scheduler.worker.policy.realized = RealizedGains(min_request_steps=1 << 30)
results = {"machine": _machine(), "sets": []}
for item in sys.argv[2:]:
    set_name, plan = item.split(":")
    sizes, repeats = plan.split("x")
    sizes, repeats = [int(s) for s in sizes.split(",")], int(repeats)
    texts, _ = take_prompts(set_name, repeats * sum(sizes))
    prompts = [chat_prompt_ids(engines["NONE"].tokenizer, p) for p in texts]
    rows = run_batches(engines, prompts, sizes, repeats, 128)
    results["sets"].append({"set": set_name, "rows": rows, "summary": summarize(rows)})
    print("\n".join(format_rows(set_name, rows)), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
