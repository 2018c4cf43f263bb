"""Batch-1 trace of one prompt: the bar-like check's round-1 prompt (mixed row START + 41) and others by index,
NONE and adaptive alternating, per-step kinds (prefill, plain without context, plain with context, drafted).
`python docs/adaptive/chat_prompt_batch1_2026-12-07.py 1100 41 4` (start, indices, repeats)."""
import sys, time, json, numpy as np
from types import SimpleNamespace
sys.path.insert(0, ".")
from sgl_dflash.tools.bench_engines import _engine, adaptive_engine, resolve_engine_args
from sgl_dflash.tools.bench_concurrency import take_prompts
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
args = SimpleNamespace(model_path=None, draft_model_path=None, speculative_token_map=None, adaptive_bound=16,
                       compilation_cache=str(__import__("pathlib").Path("cache/jax_compilation_cache").resolve()))
resolve_engine_args(args)
engines = {"NONE": _engine(args), "adaptive": adaptive_engine(args)}
rec = {}
for name, eng in engines.items():
    sch = eng.scheduler; orig = sch.step
    def step(orig=orig, name=name, sch=sch):
        w = sch.worker; d0 = getattr(w, "timings", {}).get("drafted_steps", 0); ctx = len(getattr(w, "drafting", ()))
        dec0 = sch.stats["decode_steps"]
        t0 = time.perf_counter(); r = orig(); dt = time.perf_counter() - t0
        kind = "drafted" if getattr(w, "timings", {}).get("drafted_steps", 0) > d0 else ("ctx" if ctx else "none")
        if sch.stats["decode_steps"] == dec0: kind = "prefill"
        rec.setdefault(name, []).append((dt, kind))
        return r
    sch.step = step
start = int(sys.argv[1]); idx = [int(x) for x in sys.argv[2].split(",")]; reps = int(sys.argv[3])
texts, _ = take_prompts("mixed", max(idx) + 1, start)
tok = engines["NONE"].tokenizer
# warm: a few other prompts at batch 1 through both engines
for t in texts[:2]:
    for e in engines.values(): e.generate(input_ids=[chat_prompt_ids(tok, t)], sampling_params={"max_new_tokens": 32, "temperature": 0})
for r in range(reps):
    for i in idx:
        ids = chat_prompt_ids(tok, texts[i])
        order = list(engines) if (r + i) % 2 == 0 else list(engines)[::-1]
        res = {}
        for name in order:
            rec[name] = []
            t0 = time.perf_counter()
            out = engines[name].generate(input_ids=[ids], sampling_params={"max_new_tokens": 128, "temperature": 0})
            o = out if isinstance(out, dict) else out[0]
            res[name] = (time.perf_counter() - t0, o["output_ids"], o["meta_info"])
            steps = rec[name]
            kinds = {k: (sum(1 for _, kk in steps if kk == k), round(1e3 * float(np.median([d for d, kk in steps if kk == k])), 2), round(sum(d for d, kk in steps if kk == k), 3)) for k in ("prefill", "none", "ctx", "drafted") if any(kk == k for _, kk in steps)}
            mi = res[name][2]
            print(r, i, name, "s %.3f" % res[name][0], "steps", len(steps), "sum %.3f" % sum(d for d, _ in steps), kinds,
                  "drafts", mi.get("spec_num_proposed_drafts"), "acc", mi.get("spec_accept_length"), flush=True)
        print("   ratio ada/none time %.3f" % (res["adaptive"][0] / res["NONE"][0]), "exact", res["adaptive"][1] == res["NONE"][1], flush=True)
