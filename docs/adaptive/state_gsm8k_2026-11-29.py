"""NONE, DFLASH B=8 and adaptive (bound 8), one process, engines stepping in turn (serve_warm),
engine defaults, greedy, 64 tokens; argv: concurrency levels, dataset. Run 2026-11-29 on gsm8k."""
import json, sys
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools import model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
from sgl_dflash.tools.bench_concurrency import serve_warm, take_prompts
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
from sgl_dflash import tools
use_compilation_cache(tools.CACHE_DIR / "jax_compilation_cache")
mp = str(model_import.ensure_default_model())
spec = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
            speculative_num_draft_tokens=8, speculative_adaptive=True)
conc = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
dataset = sys.argv[2] if len(sys.argv) > 2 else "mt-bench"
engines = {"NONE": Engine(model_path=mp, random_seed=0)}
engines["DFLASH B=8"] = Engine(model_path=mp, random_seed=0, **{k: v for k, v in spec.items() if k != "speculative_adaptive"})
engines["adaptive"] = Engine(model_path=mp, random_seed=0, **spec)
texts, _ = take_prompts(dataset, 24)
tok = engines["NONE"].tokenizer
prompts = [chat_prompt_ids(tok, t) for t in texts]
out = {}
for c in conc:
    row, passes = serve_warm(engines, prompts[: (4 if c == 1 else 16)], c, 64, max_passes=3)
    out[c] = {n: {k: v for k, v in r.items() if k in ("steady_tokens_per_s", "tokens_per_s", "tokens", "compiling_steps", "no_spec_fraction", "mean_verify_len")} for n, r in row.items()}
    outs = {n: r.get("outputs") for n, r in row.items()}
    out[c]["all_outputs_equal"] = len({json.dumps(o) for o in outs.values()}) == 1
    out[c]["passes"] = passes
    for n, r in out[c].items():
        if isinstance(r, dict):
            print(c, n, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    print(c, "equal", out[c]["all_outputs_equal"], "passes", passes, flush=True)
    for name in ("adaptive",):
        t = engines[name].scheduler.worker.runner._tuner
        print(name, {k: {l: [round(x * 1e3, 1) for x in v] for l, v in t.times(k).items()} for k in list(t._times and {k for k, _ in t._times})[:6]})
json.dump(out, open(f"/tmp/ab/state_{dataset}.json", "w"), indent=1)
