"""The adaptive engine's steps without drafter context against NONE's (docs/adaptive.md 2026-12-05):
NONE and an adaptive engine admitting no context serve the same MT-Bench batch (greedy, 64 new
tokens), stepping in turn, who steps first alternating each pass. Passes 0-1, 4-5 run the adaptive
engine's steps as before a change, 2-3, 6-7 as the code runs now. VARIANT names the change:
  features  before: the sample steps compute the drafter's features (6cfae2b; from 5d5c5b0 on, the
            "now" passes also skip the aux layers' capture)
  aux       before: the steps without features run the program that captures the aux layers
            (5d5c5b0)
Per pass: decode tokens/s ratio of the full steps, median scheduler step and worker ms, the layer
loops each engine ran, the tuner's readings. One JSON line per pass.

    python docs/adaptive/none_step_ab_2026-12-05.py features 8,32 8 > none_step_features_ab_2026-12-05.jsonl
    python docs/adaptive/none_step_ab_2026-12-05.py aux 1,8,32 8 > none_step_aux_ab_2026-12-05.jsonl
"""
import json, statistics, sys, time
from sgl_dflash import tools
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.speculative import adaptive_worker
from sgl_dflash.tools import model_import
from sgl_dflash.tools.bench_concurrency import serve, take_prompts
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
from sgl_dflash.tools.train.regenerate import chat_prompt_ids

use_compilation_cache(tools.CACHE_DIR / "jax_compilation_cache")
variant, CS, passes = sys.argv[1], [int(c) for c in sys.argv[2].split(',')], int(sys.argv[3])
assert variant in ("features", "aux"), variant
model = str(model_import.ensure_default_model())
engines = {"NONE": Engine(model_path=model, random_seed=0),
           "adaptive": Engine(model_path=model, random_seed=0, speculative_algorithm="DFLASH",
                              speculative_draft_model_path=str(DEFAULT_DRAFTER), speculative_num_draft_tokens=16,
                              speculative_adaptive=True)}
worker = engines["adaptive"].scheduler.worker
worker.policy.drafts_may_pay = lambda n: False
adaptive_worker.MEASURED_EVERY = 1 << 30
parts = {}
for name, eng in engines.items():
    w = eng.scheduler.worker
    orig = w.forward_batch_generation
    rec = parts.setdefault(name, [])
    def wrapped(b, orig=orig, rec=rec, w=w):
        t = time.perf_counter(); r = orig(b); rec.append((time.perf_counter() - t, len(b.slots), getattr(b, "forward_mode", None)))
        return r
    w.forward_batch_generation = wrapped
    so = eng.scheduler.step
    srec = parts.setdefault(name + "/step", [])
    def swrapped(so=so, srec=srec):
        t = time.perf_counter(); r = so(); srec.append(time.perf_counter() - t); return r
    eng.scheduler.step = swrapped
import collections
loops = {}
for name, eng in engines.items():
    r = eng.scheduler.worker.runner
    t = r._tuner
    cnt = loops.setdefault(name, collections.Counter())
    oc = t.choose_loop
    def cl(kind, batch, mode, timed, block=1, oc=oc, cnt=cnt):
        loop, key = oc(kind, batch, mode, timed, block)
        cnt[(kind, batch.kv_lens.shape[0], loop)] += 1
        return loop, key
    t.choose_loop = cl
texts, _ = take_prompts("mt-bench", max(CS))
allprompts = [chat_prompt_ids(engines["NONE"].tokenizer, t) for t in texts]
arunner = engines["adaptive"].scheduler.worker.runner
orig_jitted, orig_run, state = arunner._jitted, arunner._run, {"old": False}
def is_old(program):  # "aux", before: the steps without features ran the aux-capturing program
    return state["old"] and variant == "aux" and program.endswith(" without aux")
def jitted(cache, program, body, **st):
    if not is_old(program):
        return orig_jitted(cache, program, body, **st)
    if program + " old" not in cache:
        cache[program + " old"] = orig_jitted({}, program.removesuffix(" without aux"), body, **st)
    return cache[program + " old"]
arunner._jitted = jitted
arunner._run = lambda fn, kind, batch, program, *a, **k: orig_run(
    fn, kind, batch, program + " old" if is_old(program) else program, *a, **k)
for C, p in [(c, p) for c in CS for p in range(passes)]:
    prompts = allprompts[:C]
    for v in parts.values(): v.clear()
    patched = (p // 2) % 2 == 1
    state["old"] = not patched
    if variant == "features" and not patched:  # before: every sample step computes features
        arunner.sample = lambda *a, _s=type(arunner).sample, **k: _s(arunner, *a, **{**k, "features": True})
    else:
        arunner.__dict__.pop("sample", None)
    names = ["NONE", "adaptive"] if p % 2 == 0 else ["adaptive", "NONE"]
    served = serve({n: engines[n] for n in names}, prompts, concurrency=C, max_new_tokens=64)
    rate = {n: v["full_decode_tokens"] / max(v["full_decode_seconds"], 1e-9) for n, v in served.items()}
    out = {"c": C, "pass": p, "patched": patched, "first": names[0], "ratio": rate["adaptive"] / rate["NONE"]}
    for n in engines:
        dec = [(s, t) for (t, k, m), s in zip(parts[n], parts[n + "/step"]) if k == C]
        full = [s for s, t in dec][3:]; inner = [t for s, t in dec][3:]
        out[n] = dict(step_ms=1e3 * statistics.median(full), worker_ms=1e3 * statistics.median(inner),
                      host_ms=1e3 * statistics.median([s - t for s, t in dec][3:]), n=len(full), total_s=sum(full))
    out["loops"] = {n: {str(k): v for k, v in loops[n].items()} for n in engines}
    for n in engines:
        t = engines[n].scheduler.worker.runner._tuner
        out[n + "/tuner"] = {str(k): {l: [round(1e3 * x, 1) for x in v] for l, v in t.times(k).items()} for k in list(t._steps) if k[2] == C or k[2] == max(C, 2)}
        loops[n].clear()
    out["pages"] = {n: engines[n].scheduler.worker.allocator.num_free_pages for n in engines}
    print(json.dumps(out), flush=True)
