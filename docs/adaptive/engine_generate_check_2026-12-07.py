"""Bar-like check of issue 14: NONE and adaptive (B=16) Engines in one process, Engine.generate on
batches of unseen prompts (1, 8, 32), whole-call wall times, alternating order; 2 rounds."""
import json, sys, time
from sgl_dflash.tools.demo import use_compilation_cache
from pathlib import Path
use_compilation_cache(Path("cache/jax_compilation_cache"))
from sgl_dflash.tools import model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools.bench_concurrency import take_prompts

model = str(model_import.ensure_default_model())
t = time.perf_counter()
none = Engine(model_path=model, random_seed=0)
print("NONE startup", time.perf_counter() - t, flush=True)
t = time.perf_counter()
ada = Engine(model_path=model, random_seed=0, speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
             speculative_num_draft_tokens=16, speculative_adaptive=True)
print("adaptive startup", time.perf_counter() - t, flush=True)
ctx = {"n": 0}
_add = ada.scheduler.worker.add_context
def add_context(slot, f):
    ctx["n"] += 1; return _add(slot, f)
ada.scheduler.worker.add_context = add_context
import gc, os
GC = {"t": 0.0, "s": None, "n2": 0}
def cb(phase, info):
    if phase == "start": GC["s"] = time.perf_counter()
    elif GC["s"] is not None:
        GC["t"] += time.perf_counter() - GC["s"]; GC["n2"] += info["generation"] == 2
gc.callbacks.append(cb)
if os.environ.get("FREEZE"): gc.collect(); gc.freeze(); print("frozen", gc.get_freeze_count())
start = int(sys.argv[1]) if len(sys.argv) > 1 else 200
texts, _ = take_prompts("mixed", 2 * 2 * (1 + 8 + 32), start)
sp = {"temperature": 0, "max_new_tokens": 128}
rows, cur = [], 0
for rnd in range(2):
    for b in (1, 8, 32):
        out = {}
        order = [("NONE", none), ("adaptive", ada)]
        if (rnd + b) % 2: order.reverse()
        for name, eng in order:
            ps = [[{"role": "user", "content": p}] for p in texts[cur:cur + b]]
            prompts = [eng.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in ps]
            GC["t"] = 0.0; GC["n2"] = 0
            t = time.perf_counter()
            res = eng.generate(prompts, sp)
            dt = time.perf_counter() - t
            toks = sum(len(r["output_ids"]) for r in res)
            print("   ", name, "sec %.2f gc %.3f s, full %d" % (dt, GC["t"], GC["n2"]), flush=True)
            out[name] = dict(seconds=dt, tokens=toks, tps=toks / dt, ids=[r["output_ids"] for r in res])
            if name == "adaptive":
                k = sum(r["meta_info"].get("spec_num_proposed_drafts", 0) for r in res)
                v = sum(r["meta_info"].get("spec_verify_ct", 0) for r in res)
                print("   adaptive: contexts so far", ctx["n"], "proposed drafts", k, "verify steps", v, "sec %.2f" % dt, "none-first" if order[0][0] == "NONE" else "ada-first", flush=True)
        cur += b  # both engines served the same prompts; next batch new prompts
        ms = [r for r in out["adaptive"].get("metas", [])]
        exact = sum(a == c for a, c in zip(out["NONE"]["ids"], out["adaptive"]["ids"]))
        r = dict(round=rnd, batch=b, first=order[0][0], none_tps=out["NONE"]["tps"], ada_tps=out["adaptive"]["tps"],
                 ratio=out["adaptive"]["tps"] / out["NONE"]["tps"], exact=exact)
        print(r, flush=True)
        rows.append(r)
json.dump(rows, open(f"bench_results/engine_generate_check_{start}.json", "w"), indent=1)
