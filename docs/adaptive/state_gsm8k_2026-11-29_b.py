"""NONE, DFLASH B=8 and adaptive (bound 8), one process, engines stepping in turn (serve_warm),
engine defaults, greedy, 64 tokens, 2c prompts per level (4 at c=1); argv: levels, dataset."""
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
conc = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8, 32]
dataset = sys.argv[2] if len(sys.argv) > 2 else "gsm8k"
engines = {"NONE": Engine(model_path=mp, random_seed=0)}
engines["DFLASH B=8"] = Engine(model_path=mp, random_seed=0, **{k: v for k, v in spec.items() if k != "speculative_adaptive"})
engines["adaptive"] = Engine(model_path=mp, random_seed=0, **spec)
texts, _ = take_prompts(dataset, 64)
tok = engines["NONE"].tokenizer
prompts = [chat_prompt_ids(tok, t) for t in texts]
out = {}
keys = ("steady_tokens_per_s", "tokens_per_s", "tokens", "compiling_steps", "no_spec_fraction", "mean_verify_len", "tokens_per_step")
for c in conc:
    row, passes = serve_warm(engines, prompts[: max(4, 2 * c)], c, 64, max_passes=3)
    out[c] = {n: {k: v for k, v in r.items() if k in keys} for n, r in row.items()}
    for n in row:
        out[c][n]["x_NONE"] = row[n]["steady_tokens_per_s"] / row["NONE"]["steady_tokens_per_s"]
    out[c]["all_outputs_equal"] = len({json.dumps(r["outputs"]) for r in row.values()}) == 1
    out[c]["passes"] = passes
    for n, r in out[c].items():
        if isinstance(r, dict):
            print(c, n, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    print(c, "equal", out[c]["all_outputs_equal"], "passes", passes, flush=True)
json.dump(out, open(f"/tmp/ab/state_{dataset}.json", "w"), indent=1)
