"""A prefill of 32 prompts in NONE and adaptive Engines in one process (docs/adaptive.md, seventh
session): 8 rounds of new mixed prompts, max_new_tokens 2, the engines taking turns first; per call
wall seconds, JAX compiles (CompileCounter), minor page faults, garbage-collector seconds, prompt tokens.
`python docs/adaptive/prefill_order_2026-12-07.py NONE` (argv 1: which engine goes first in round 0)."""
import resource, sys, time, json
from pathlib import Path
from sgl_dflash.tools.demo import use_compilation_cache
use_compilation_cache(Path("cache/jax_compilation_cache"))
from sgl_dflash.tools import model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools.bench_concurrency import take_prompts
from jax_backend.compile_counter import CompileCounter
CompileCounter.install()
import gc
GC = {"t": 0.0, "s": None, "full": 0}
def _gc(phase, info):
    if phase == "start": GC["s"] = time.perf_counter()
    elif GC["s"] is not None:
        GC["t"] += time.perf_counter() - GC["s"]; GC["full"] += info["generation"] == 2
gc.callbacks.append(_gc)
model = str(model_import.ensure_default_model())
first = sys.argv[1] if len(sys.argv) > 1 else "NONE"
t = time.perf_counter()
engines = {"NONE": Engine(model_path=model, random_seed=0)}
print("NONE startup %.1f" % (time.perf_counter() - t), flush=True)
t = time.perf_counter()
engines["adaptive"] = Engine(model_path=model, random_seed=0, speculative_algorithm="DFLASH",
    speculative_draft_model_path=str(DEFAULT_DRAFTER), speculative_num_draft_tokens=16, speculative_adaptive=True)
print("adaptive startup %.1f" % (time.perf_counter() - t), flush=True)
order = ["NONE", "adaptive"] if first == "NONE" else ["adaptive", "NONE"]
texts, _ = take_prompts("mixed", 32 * 8, 2000)
sp = {"temperature": 0, "max_new_tokens": int(sys.argv[2]) if len(sys.argv) > 2 else 2}
for rnd in range(8):
    order = order[::-1] if rnd else order
    ps = texts[32 * rnd: 32 * rnd + 32]
    for name in order:
        eng = engines[name]
        prompts = [eng.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in ps]
        c0, s0, f0 = CompileCounter.count, CompileCounter.seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        GC['t'] = 0.0; GC['full'] = 0
        t = time.perf_counter()
        res = eng.generate(prompts, sp)
        dt = time.perf_counter() - t
        f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        print(f"round {rnd} {name:9s} {dt:6.2f} s  compiles {CompileCounter.count - c0} ({CompileCounter.seconds - s0:.2f} s) minflt {f1 - f0} gc {GC['t']:.2f} s ({GC['full']} full) tokens {sum(len(eng.tokenizer(p)['input_ids']) for p in prompts)}", flush=True)
