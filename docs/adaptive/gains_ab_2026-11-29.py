"""A/B in one adaptive engine: passes alternate between the policy's estimate updates, before
(per-position rate averages) and after (averaged gains); NONE and DFLASH B=8 step beside it in
every pass (serve: engines in turn). Defaults, greedy, 64 tokens. argv: concurrency levels, dataset,
the before-module's path. A record of the run: "after" was the averaged-gains observe then in the
working tree (docs/adaptive.md, 2026-11-29 late morning), "before" HEAD's 6dfa381; not kept, so the
repository's observe is the "before" one now."""
import json, sys, types, importlib.util, statistics
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools import model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
from sgl_dflash.tools.bench_concurrency import serve, serve_warm, take_prompts
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
from sgl_dflash.speculative.adaptive import AdaptivePolicy
from sgl_dflash import tools
spec_ = importlib.util.spec_from_file_location("adaptive_old", sys.argv[3] if len(sys.argv) > 3 else "/tmp/ab/adaptive_old.py")
old = importlib.util.module_from_spec(spec_); sys.modules["adaptive_old"] = old; spec_.loader.exec_module(old)
use_compilation_cache(tools.CACHE_DIR / "jax_compilation_cache")
mp = str(model_import.ensure_default_model())
spec = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
            speculative_num_draft_tokens=8, speculative_adaptive=True)
conc = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
dataset = sys.argv[2] if len(sys.argv) > 2 else "gsm8k"
engines = {"NONE": Engine(model_path=mp, random_seed=0)}
engines["DFLASH B=8"] = Engine(model_path=mp, random_seed=0, **{k: v for k, v in spec.items() if k != "speculative_adaptive"})
engines["adaptive"] = Engine(model_path=mp, random_seed=0, **spec)
pol = engines["adaptive"].scheduler.worker.policy
variants = {"before": types.MethodType(old.AdaptivePolicy.observe, pol), "after": types.MethodType(AdaptivePolicy.observe, pol)}
texts, _ = take_prompts(dataset, 24)
tok = engines["NONE"].tokenizer
prompts = [chat_prompt_ids(tok, t) for t in texts]
out = {}
for c in conc:
    ps = prompts[: (6 if c == 1 else 16)]
    pol.observe = variants["after"]
    serve_warm(engines, ps, c, 64, max_passes=2)
    runs = {"before": [], "after": []}
    for rnd in range(3):
        for name in ("before", "after") if rnd % 2 == 0 else ("after", "before"):
            pol.observe = variants[name]
            row = serve(engines, ps, c, 64)
            r = {n: row[n]["steady_tokens_per_s"] for n in row}
            rec = dict(tps=r, x_none=r["adaptive"] / r["NONE"], x_b8=r["adaptive"] / r["DFLASH B=8"],
                       no_spec=row["adaptive"].get("no_spec_fraction"), verify_len=row["adaptive"].get("mean_verify_len"),
                       compiling=row["adaptive"]["compiling_steps"], equal=row["adaptive"]["outputs"] == row["NONE"]["outputs"])
            runs[name].append(rec)
            print(c, name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items() if k != "tps"}, {k: round(v, 2) for k, v in r.items()}, flush=True)
    out[c] = {n: dict(runs=v, median_x_none=statistics.median(x["x_none"] for x in v), median_x_b8=statistics.median(x["x_b8"] for x in v)) for n, v in runs.items()}
    print(c, {n: (round(v["median_x_none"], 3), round(v["median_x_b8"], 3)) for n, v in out[c].items()}, flush=True)
json.dump(out, open(f"/tmp/ab/gains_ab2_{dataset}.json", "w"), indent=1)
