"""Paired plain steps, NONE vs an adaptive engine whose requests never get drafter context (LEAN=1: its
decode step replaced by the target's own, the floor): per-part medians. python docs/adaptive/none_step_pairs_2026-12-07.py 1"""
import sys, time, collections
from pathlib import Path
import numpy as np
from sgl_dflash.tools.demo import use_compilation_cache, DEFAULT_DRAFTER
use_compilation_cache(Path("cache/jax_compilation_cache"))
from sgl_dflash.tools import model_import, bench_plain_step
from sgl_dflash.speculative import adaptive_worker
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools.bench_concurrency import prompt_sets
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
adaptive_worker.MEASURED_EVERY = 10**9
model = str(model_import.ensure_default_model())
engines = {"NONE": Engine(model_path=model, random_seed=0),
           "adaptive": Engine(model_path=model, random_seed=0, speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
                              speculative_num_draft_tokens=16, speculative_adaptive=True)}
engines["adaptive"].scheduler.worker.policy.drafts_may_pay = lambda n: False
import os
if os.environ.get("LEAN"):
    w = engines["adaptive"].scheduler.worker
    def lean_decode(batch):
        r = w.target_worker.forward_decode(batch)
        n = len(batch.slots)
        r.accept_lens = r.verify_lens = np.zeros(n, np.int32); r.num_draft_tokens = w.block_size - 1
        return r
    w.forward_decode = lean_decode

T = collections.defaultdict(list)
def wrap(obj, attr, key):
    f = getattr(obj, attr)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[key].append(time.perf_counter() - t); return r
    setattr(obj, attr, g)
for name, e in engines.items():
    w = e.scheduler.worker
    wrap(w, "forward_batch_generation", name + ".worker")
    runner = w.runner if hasattr(w, "runner") else w.target_worker.runner
    wrap(runner, "sample", name + ".runner.sample")
    wrap(runner, "_run", name + ".runner._run")
    wrap(e.scheduler, "process_batch_result", name + ".process")
    wrap(e.scheduler, "_reserve_decode_pages", name + ".reserve")
    print(name, "tokens_per_step", w.tokens_per_step, "record_aux", getattr(getattr(w, "target_worker", w), "record_aux", None))
tok = engines["NONE"].tokenizer
b = int(sys.argv[1])
prompts = [chat_prompt_ids(tok, p) for p in prompt_sets(["mt-bench"], b, 5)["mt-bench"]]
T.clear()
m = bench_plain_step.measure(engines, prompts, 300)
print(bench_plain_step.summarize(b, m))
for k, v in sorted(T.items()):
    v = np.array(v[-300:]) * 1e3
    print(f"{k:30s} n={len(v)} median {np.median(v):.3f} ms mean {v.mean():.3f}")
