"""Who steps first (docs/performance.md section 36): two identical target runners (NONE) take a
32-prompt prefill each, in an order alternating per round, then (MODE) decode steps in turn and/or
an idle second; the first prefill's time over the second's per round, and each one's page faults.

    MODE=decode_both_sleep python docs/performance/order_effect_2026-12-04.py

MODE contains any of: decode (10 decode steps; "both": by both runners, else by A only), sleep
(1 s idle), spin (1 s busy); "none": prefills back to back.
"""
import sys, time, resource
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import numpy as np
from jax_backend.runner import TargetRunner
from jax_backend.batch import SeqInput
path = ROOT / "cache/models/SmolLM2-135M-Instruct"
rng = np.random.default_rng(0)
flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def make():
    r = TargetRunner(path, max_num_seqs=48, max_model_len=8200, max_total_tokens=16384)
    return r
R = {"A": make(), "B": make()}
lens = [int(rng.integers(80, 140)) for _ in range(32)]
res = {"A": [], "B": []}
for rep in range(6):
    prompts = [rng.integers(0, 40000, n).tolist() for n in lens]  # same lengths: same shapes
    order = ["A", "B"] if rep % 2 == 0 else ["B", "A"]
    work = {}
    for k in order:
        r = R[k]
        [r.allocator.free(i) for i in range(32) if rep]
        tables = [r.allocator.allocate(i, n + 40) for i, n in enumerate(lens)]
        work[k] = ([SeqInput(p, 0, t, "last") for p, t in zip(prompts, tables)],
                   [SeqInput([5], n, t, "last") for n, t in zip(lens, tables)])
    for k in order:
        f0, t0 = flt(), time.perf_counter(); R[k].forward(work[k][0]); dt = time.perf_counter() - t0
        res[k].append(dt); print(rep, k, "first" if k == order[0] else "second", f"{dt:.3f}s faults {flt()-f0}", flush=True)
    import os
    if "decode" in os.environ["MODE"]:
        for _ in range(10):
            for k in (order if "both" in os.environ["MODE"] else ["A"]): R[k].sample(work[k][1], [0.0]*32, [1.0]*32, [0]*32)
    if "sleep" in os.environ["MODE"]:
        time.sleep(1.0)
    if "spin" in os.environ["MODE"]:
        t = time.perf_counter()
        while time.perf_counter() - t < 1.0: pass
first = [res[("A", "B")[rep % 2]][rep] for rep in range(6)]
second = [res[("B", "A")[rep % 2]][rep] for rep in range(6)]
print("first/second per rep", [f"{a/b:.3f}" for a, b in zip(first, second)])
