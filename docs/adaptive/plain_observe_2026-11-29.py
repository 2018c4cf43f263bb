"""observe() of a plain step, before (the module at argv[1], HEAD 5a7c451) vs after (the short path): same estimates, host ms. A record of the run."""
import importlib.util, sys, time, numpy as np
from sgl_dflash.speculative import adaptive as new
spec_ = importlib.util.spec_from_file_location("adaptive_head", sys.argv[1] if len(sys.argv) > 1 else "/tmp/ab/adaptive_head.py")
old = importlib.util.module_from_spec(spec_); sys.modules["adaptive_head"] = old; spec_.loader.exec_module(old)
for n in (1, 8, 32):
    pols = {"old": old.AdaptivePolicy(7), "new": new.AdaptivePolicy(7)}
    for p in pols.values():
        for s in range(n): p.add(s)
    slots, modes, z = list(range(n)), np.zeros(n, np.int64), np.zeros(n, np.int64)
    t = {k: [] for k in pols}
    for rep in range(400):
        for k, p in pols.items():
            a = time.perf_counter(); p.observe(slots, modes, np.zeros(n, bool), np.zeros((n, 7), np.float32), z, z, 8); t[k].append(time.perf_counter() - a)
    same = all(np.array_equal(pols["old"].requests[s].estimate, pols["new"].requests[s].estimate) for s in slots)
    print(n, {k: round(np.median(v) * 1e3, 3) for k, v in t.items()}, "ratio", round(np.median(t["new"]) / np.median(t["old"]), 2), "same estimates", same)
