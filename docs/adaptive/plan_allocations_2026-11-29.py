"""plan_drafts before (HEAD 4026b25, path in the script) vs after (one set of allocations for every draft block): same plans, host ms. A record of the run."""
import importlib.util, sys, time, numpy as np
from sgl_dflash.speculative import adaptive as new
spec_ = importlib.util.spec_from_file_location("adaptive_head", "/tmp/ab/adaptive_head.py")
old = importlib.util.module_from_spec(spec_); sys.modules["adaptive_head"] = old; spec_.loader.exec_module(old)
def make(mod, n):
    p = mod.AdaptivePolicy(7, explore_every=0)
    for s in range(n): p.add(s); p.requests[s].estimate[:] = np.linspace(0.6, 0.3, 7)
    for _ in range(5):
        p.cost.observe((n, n, 1), 0.060, 0, 0, 0.001)
        for b in (2, 4, 8):
            for T in (16, 32, 64):
                p.cost.observe((n, T, b), 0.06 + T * 0.001, n, 0.02, 0.001, draft_block=b)
    return p
for n in (1, 8, 32):
    pols = {"old": make(old, n), "new": make(new, n)}
    slots = list(range(n))
    plans = {k: [] for k in pols}
    t = {k: [] for k in pols}
    for rep in range(400):
        for k, p in pols.items():
            a = time.perf_counter(); plan = p.plan_drafts(slots); t[k].append(time.perf_counter() - a)
            plans[k].append((plan.block, plan.drafted.tolist()))
    same = plans["old"] == plans["new"]
    print(n, {k: round(np.median(v) * 1e3, 3) for k, v in t.items()}, "ratio", round(np.median(t["new"]) / np.median(t["old"]), 2), "same plans", same, plans["new"][0][0])
