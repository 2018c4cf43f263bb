"""The adaptive engine's steps without drafter context, with and without the aux layers captured
(docs/adaptive.md 2026-12-05, afternoon): NONE and an adaptive engine admitting no context serve the
same MT-Bench batch (greedy, 64 new tokens), stepping in turn, who steps first alternating each
pass; passes 0-1, 4-5 run the adaptive engine's steps in the sampling program that captures the
drafter's aux layers (before the change; no features computed), 2-3, 6-7 in NONE's program (the
change). Per pass: decode tokens/s ratio of the full steps, median scheduler step and worker ms,
the layer loops each engine ran, the tuner's readings. One JSON line per pass.

    python docs/adaptive/none_step_aux_ab_2026-12-05.py 1,8,32 8 > OUT.jsonl
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
CS, passes = [int(c) for c in sys.argv[1].split(',')], int(sys.argv[2])
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
def old_name(program):  # before the change: the steps without features ran the aux-capturing program
    return program + " old" if state["old"] and program.endswith("without aux") else program
arunner._jitted = lambda cache, program, body, aux=True, **st: orig_jitted(
    cache, old_name(program), body, aux=aux or old_name(program) != program, **st)
arunner._run = lambda fn, kind, batch, program, *a, **k: orig_run(fn, kind, batch, old_name(program), *a, **k)
for C, p in [(c, p) for c in CS for p in range(passes)]:
    prompts = allprompts[:C]
    for v in parts.values(): v.clear()
    patched = (p // 2) % 2 == 1
    state["old"] = not patched
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
