"""Greedy decode steps of two TargetRunners (the real model, the engine's defaults otherwise), one with the
greedy head (VNNI here) and one without, alternating step by step on the same sequences: medians."""
import sys, time
import numpy as np
from jax_backend import SeqInput, TargetRunner, cpu_kernels
from sgl_dflash.tools import model_import
model = str(model_import.ensure_default_model())
runners = {"head": TargetRunner(model, max_total_tokens=16384, greedy_head=True),
           "no head": TargetRunner(model, max_total_tokens=16384, greedy_head=False)}
rng = np.random.default_rng(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
for n in (1, 8, 32):
    prompts = [rng.integers(100, 20000, int(m)).tolist() for m in rng.integers(60, 120, n)]
    state = {}
    for name, r in runners.items():
        r.allocator.reset() if hasattr(r.allocator, "reset") else None
        tables = [r.allocator.allocate(1000 * n + i, len(p) + steps + 8) for i, p in enumerate(prompts)]
        r.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
        state[name] = (tables, [p[-1] for p in prompts], [len(p) for p in prompts], [])
    times = {k: [] for k in runners}
    for s in range(steps):
        for name in (list(runners) if s % 2 else list(runners)[::-1]):
            r = runners[name]; tables, last, lens, out = state[name]
            t = time.perf_counter()
            o = r.sample([SeqInput([last[i]], lens[i], tables[i]) for i in range(n)], [0.0] * n, [1.0] * n, [0] * n, features=False)
            times[name].append(time.perf_counter() - t)
            last[:] = [int(x) for x in o.tokens]; lens[:] = [l + 1 for l in lens]; out.append(list(last))
    assert state["head"][3] == state["no head"][3], "tokens differ"
    m = {k: 1e3 * np.median(v[4:]) for k, v in times.items()}
    pairs = np.median(np.array(times["head"][4:]) / np.array(times["no head"][4:]))
    print(f"batch {n}: head {m['head']:.2f} ms, no head {m['no head']:.2f} ms, paired ratio {pairs:.3f}, same tokens", flush=True)
