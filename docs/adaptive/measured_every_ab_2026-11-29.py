"""A/B in one adaptive engine at the admission rule: every 64th request given drafter context
(MEASURED_EVERY 64, shipped) vs none (10**9), passes alternating, NONE beside it."""
import json, sys
import numpy as np
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools import model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
from sgl_dflash.tools.bench_concurrency import serve, take_prompts
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
from sgl_dflash import tools
from sgl_dflash.speculative import adaptive_worker
use_compilation_cache(tools.CACHE_DIR / "jax_compilation_cache")
mp = str(model_import.ensure_default_model())
c, pairs, dataset = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "gsm8k"
engines = {"NONE": Engine(model_path=mp, random_seed=0),
           "adaptive": Engine(model_path=mp, random_seed=0, speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
                              speculative_num_draft_tokens=16, speculative_adaptive=True)}
policy = engines["adaptive"].scheduler.worker.policy
texts, _ = take_prompts(dataset, 2 * c + 8)
prompts = [chat_prompt_ids(engines["NONE"].tokenizer, t) for t in texts][8:8 + 2 * c]
rows = []
for p in range(1 + 2 * pairs):
    mode = "measured" if p % 2 == 0 else "never"
    adaptive_worker.MEASURED_EVERY = 64 if mode == "measured" else 10**9
    row = serve(engines, prompts, c, 64)
    r = {n: dict(steady=round(v["steady_tokens_per_s"], 2), prefill_s=round(v["prefill_seconds"], 3),
                 decode_rate=round(v["full_decode_tokens"] / max(v["full_decode_seconds"], 1e-9), 2), compiling=v["compiling_steps"],
                 no_spec=v.get("no_spec_fraction")) for n, v in row.items()}
    r.update(mode=mode, ratio=round(r["adaptive"]["steady"] / r["NONE"]["steady"], 4), equal=row["NONE"]["outputs"] == row["adaptive"]["outputs"],
             with_context=sum(1 for _ in engines["adaptive"].scheduler.worker.drafting), admitted=engines["adaptive"].scheduler.worker.admitted,
             trials=float(policy.calibrator.position_trials[0, 0]))
    print("pass", p, json.dumps(r), flush=True)
    rows.append(r)
for mode in ("measured", "never"):
    ratios = [r["ratio"] for r in rows[1:] if r["mode"] == mode]
    print(mode, "median adaptive/NONE", np.median(ratios), ratios)
json.dump(rows, open(f"/tmp/ab3/ab_measured_{dataset}_{c}.json", "w"), indent=1)
print("drafts_may_pay after the passes (admit_ratio 1.0):")
policy.admit_ratio = 1.0
for n in (1, 2, 4, 8, 16, 32):
    print(n, policy.drafts_may_pay(n))
