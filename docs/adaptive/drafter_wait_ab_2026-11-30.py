"""A/B of charging a step with the drafter's work it leaves behind (`AdaptiveDFlashWorker._observe_last`)
in one process: NONE and two adaptive engines (the wait charged to the step that left it: the default
now; not charged: as before), stepping in turn through `bench_concurrency.serve`, c requests in flight,
2c prompts a pass, 64 new tokens, greedy, engine defaults but the startup sweep (two swept adaptive
engines do not fit one process's mappings: the first pass compiles). A record of the run:

    .venv/bin/python -u docs/adaptive/drafter_wait_ab_2026-11-30.py c passes set [set ...]
"""
import json, sys
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools import bench_concurrency as bc, model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
from sgl_dflash.tools.train.regenerate import chat_prompt_ids

c, passes, sets = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] or ["mixed"]
use_compilation_cache()
model = str(model_import.ensure_default_model())
spec = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
            speculative_token_map=str(DEFAULT_DRAFTER / "token_map.json"))
engines = {"NONE": Engine(model_path=model, random_seed=0)}
for name in ("adaptive wait charged", "adaptive not charged"):
    engines[name] = Engine(model_path=model, random_seed=0, speculative_num_draft_tokens=16, speculative_adaptive=True,
                           disable_precompile=True, **spec)
worker = engines["adaptive not charged"].scheduler.worker
worker._observe_last = lambda waited, observe=worker._observe_last: observe(0.0)  # the reading as before
rows = []
for name in sets:
    prompts = [chat_prompt_ids(engines["NONE"].tokenizer, p) for p in bc.prompt_sets([name], 2 * c)[name]]
    for i in range(passes):
        order = list(engines)[i % 3:] + list(engines)[: i % 3]  # who steps first rotates
        result = bc.serve({k: engines[k] for k in order}, prompts, c, 64)
        rate = {k: r["steady_tokens_per_s"] for k, r in result.items()}
        row = {"set": name, "c": c, "pass": i, "tokens_per_s": rate, "vs_NONE": {k: rate[k] / rate["NONE"] for k in rate},
               "charged_vs_not": rate["adaptive wait charged"] / rate["adaptive not charged"],
               "compiling_steps": {k: r["compiling_steps"] for k, r in result.items()},
               "no_spec_fraction": {k: r.get("no_spec_fraction") for k, r in result.items()},
               "exact": all(r["outputs"] == result["NONE"]["outputs"] for r in result.values())}
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(f"docs/adaptive/drafter_wait_ab_2026-11-30_c{c}.json", "w"), indent=1)
