"""A/B of TUNED_VERIFY_SEQS (verify steps of small batches timed in both layer loops) in one process:
NONE, a fixed block of 4, and two adaptive engines (tuned_verify_seqs 0: the scan for every verify
step, as before; 2: the default now) stepping in turn through `bench_concurrency.serve`, c = 1, 64 new
tokens, greedy, `passes` passes per set (the first compiles: the adaptive engines run without the
startup sweep, since two swept adaptive engines do not fit one process's mappings). A record of the run:

    .venv/bin/python -u docs/adaptive/tuned_verify_ab_2026-11-29.py [passes] [sets...]
"""
import json, sys
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools import bench_concurrency as bc, model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
from sgl_dflash.tools.train.regenerate import chat_prompt_ids

passes, sets = int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2:] or ["gsm8k", "mixed"]
use_compilation_cache()
model = str(model_import.ensure_default_model())
spec = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
            speculative_token_map=str(DEFAULT_DRAFTER / "token_map.json"))
engines = {"NONE": Engine(model_path=model, random_seed=0),
           "B=4": Engine(model_path=model, random_seed=0, speculative_num_draft_tokens=4, **spec)}
for name, seqs in (("adaptive scan", 0), ("adaptive tuned 2", 2)):
    engines[name] = Engine(model_path=model, random_seed=0, speculative_num_draft_tokens=16, speculative_adaptive=True,
                           disable_precompile=True, **spec)
    engines[name].scheduler.worker.runner.tuned_verify_seqs = seqs
rows = []
for name in sets:
    prompts = [chat_prompt_ids(engines["NONE"].tokenizer, p) for p in bc.prompt_sets([name], 4)[name]]
    for i in range(passes):
        order = list(engines)[i % 4:] + list(engines)[: i % 4]  # who steps first rotates
        result = bc.serve({k: engines[k] for k in order}, prompts, 1, 64)
        rate = {k: r["steady_tokens_per_s"] for k, r in result.items()}
        row = {"set": name, "pass": i, "tokens_per_s": rate,
               "vs_B=4": {k: rate[k] / rate["B=4"] for k in rate}, "vs_NONE": {k: rate[k] / rate["NONE"] for k in rate},
               "compiling_steps": {k: r["compiling_steps"] for k, r in result.items()},
               "no_spec_fraction": {k: r.get("no_spec_fraction") for k, r in result.items()},
               "exact": all(r["outputs"] == result["NONE"]["outputs"] for r in result.values())}
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open("docs/adaptive/tuned_verify_ab_2026-11-29.json", "w"), indent=1)
