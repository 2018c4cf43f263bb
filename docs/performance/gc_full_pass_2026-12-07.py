"""How long Python's full garbage collection takes in a process serving the real pair, before and
after gc_control.freeze (a server's default), and how many full passes a served batch triggers."""
import gc, json, sys, time, argparse, collections
sys.path.insert(0, ".")
from sgl_dflash.managers import gc_control
from sgl_dflash.tools.bench_engines import add_engine_args, resolve_engine_args, adaptive_engine, _engine
from sgl_dflash.tools.bench_concurrency import take_prompts, serve
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
p = argparse.ArgumentParser(); add_engine_args(p); args = p.parse_args(sys.argv[1:]); resolve_engine_args(args)
engines = {"NONE": _engine(args), "adaptive": adaptive_engine(args)}
def full_pass():
    t = time.perf_counter(); gc.collect(); return time.perf_counter() - t
passes = collections.Counter(); spent = collections.Counter(); t0 = {}
def cb(phase, info):
    if phase == "start": t0["t"] = time.perf_counter()
    else: passes[info["generation"]] += 1; spent[info["generation"]] += time.perf_counter() - t0["t"]
gc.callbacks.append(cb)
texts, _ = take_prompts("mixed", 16)
prompts = [chat_prompt_ids(engines["NONE"].tokenizer, t) for t in texts]
result = {"objects_tracked": len(gc.get_objects())}
result["full_pass_s_before"] = sorted(full_pass() for _ in range(3))
passes.clear(); spent.clear()
serve(engines, prompts[:8], concurrency=8, max_new_tokens=64)
result["served_8_before"] = {"passes": dict(passes), "seconds": {g: round(s, 3) for g, s in spent.items()}}
result["frozen"] = gc_control.freeze("measured")
result["full_pass_s_after"] = sorted(full_pass() for _ in range(3))
passes.clear(); spent.clear()
serve(engines, prompts[8:16], concurrency=8, max_new_tokens=64)
result["served_8_after"] = {"passes": dict(passes), "seconds": {g: round(s, 3) for g, s in spent.items()}}
print(json.dumps(result, indent=1))
