"""What the adaptive engine's steps cost when no request has drafter context (`_none_step`),
against NONE's, in one process: both engines with the defaults serve the same batch (MT-Bench,
greedy, 64 new tokens) at 8 and 32 requests, stepping in turn, passes alternating who steps
first; the adaptive engine admits no context (`drafts_may_pay` answers no, no request is kept to
measure). Prints and writes decode tokens/s of the batch's full steps and the ratio per pass.

    python docs/adaptive/none_steps_ab_2026-12-03.py OUT.json [passes]
"""
import json
import statistics
import sys

from sgl_dflash import tools
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.speculative import adaptive_worker
from sgl_dflash.tools import model_import
from sgl_dflash.tools.bench_concurrency import serve, take_prompts
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
from sgl_dflash.tools.train.regenerate import chat_prompt_ids

use_compilation_cache(tools.CACHE_DIR / "jax_compilation_cache")
out, passes = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
model = str(model_import.ensure_default_model())
engines = {"NONE": Engine(model_path=model, random_seed=0),
           "adaptive": Engine(model_path=model, random_seed=0, speculative_algorithm="DFLASH",
                              speculative_draft_model_path=str(DEFAULT_DRAFTER), speculative_num_draft_tokens=16,
                              speculative_adaptive=True)}
worker = engines["adaptive"].scheduler.worker
worker.policy.drafts_may_pay = lambda n: False
adaptive_worker.MEASURED_EVERY = 1 << 30
texts, _ = take_prompts("mt-bench", 32)
prompts = [chat_prompt_ids(engines["NONE"].tokenizer, t) for t in texts]
rows = []
for c in (8, 32):
    for p in range(passes):
        names = ["NONE", "adaptive"] if p % 2 == 0 else ["adaptive", "NONE"]
        served = serve({n: engines[n] for n in names}, prompts[:c], concurrency=c, max_new_tokens=64)
        rate = {n: v["full_decode_tokens"] / max(v["full_decode_seconds"], 1e-9) for n, v in served.items()}
        row = dict(c=c, p=p, first=names[0], none=rate["NONE"], adaptive=rate["adaptive"],
                   ratio=rate["adaptive"] / rate["NONE"], equal=served["NONE"]["outputs"] == served["adaptive"]["outputs"],
                   compiling={n: v["compiling_steps"] for n, v in served.items()}, with_context=len(worker.drafting))
        print(json.dumps(row), flush=True)
        rows.append(row)
    ratios = [r["ratio"] for r in rows if r["c"] == c][1:]  # the first pass meets the shapes
    print(f"c={c}: adaptive/NONE decode rate, passes 1..: {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")
json.dump(rows, open(out, "w"), indent=1)
