"""Per-step wall times at batch 1 for NONE, B=4 and adaptive on mt-bench prompts, engines rotating per prompt."""
import sys, time, json, numpy as np
from types import SimpleNamespace
sys.path.insert(0, ".")
from sgl_dflash.tools.bench_engines import _engine, adaptive_engine, resolve_engine_args
from sgl_dflash.tools.bench_concurrency import take_prompts
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
args = SimpleNamespace(model_path=None, draft_model_path=None, speculative_token_map=None, adaptive_bound=16,
                       compilation_cache=str(__import__("pathlib").Path("cache/jax_compilation_cache").resolve()))
resolve_engine_args(args)
engines = {"NONE": _engine(args), "B=4": _engine(args, speculative_num_draft_tokens=4), "adaptive": adaptive_engine(args)}
rec = {}
for name, eng in engines.items():
    sch = eng.scheduler; orig = sch.step
    def step(orig=orig, name=name, sch=sch):
        w = sch.worker; d0 = getattr(w, "timings", {}).get("drafted_steps", 0); ctx = len(getattr(w, "drafting", ()))
        dec0 = sch.stats["decode_steps"]
        t0 = time.perf_counter(); r = orig(); dt = time.perf_counter() - t0
        if sch.stats["decode_steps"] > dec0:
            kind = "drafted" if getattr(w, "timings", {}).get("drafted_steps", 0) > d0 else ("ctx" if ctx else "none")
            rec.setdefault(name, []).append((dt, kind))
        return r
    sch.step = step
n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
texts, _ = take_prompts("mt-bench", n)
names = list(engines)
tok = engines["NONE"].tokenizer
for i, t in enumerate(texts):
    ids = chat_prompt_ids(tok, t)
    order = names[i % 3:] + names[: i % 3]
    res = {}
    for name in order:
        rec[name] = []
        t0 = time.perf_counter()
        out = engines[name].generate(input_ids=[ids], sampling_params={"max_new_tokens": 128, "temperature": 0})
        res[name] = (time.perf_counter() - t0, out["output_ids"] if isinstance(out, dict) else out[0]["output_ids"])
        steps = rec[name]
        kinds = {k: (sum(1 for _, kk in steps if kk == k), round(1e3 * float(np.median([d for d, kk in steps if kk == k])), 2) if any(kk == k for _, kk in steps) else None) for k in ("none", "ctx", "drafted")}
        print(i, name, "s", round(res[name][0], 3), "steps", len(steps), "sum", round(sum(d for d, _ in steps), 3), kinds, flush=True)
    assert all(res[k][1] == res["NONE"][1] for k in res)
