"""The real target's steps with the few-rows Q4_1 tile products on and off IN ONE PROCESS (builds
in separate processes read +-10% apart on this host): apply few_rows_toggle_2026-12-07.diff (a
temporary getenv switch, not kept), then `python docs/performance/few_rows_steps_2026-12-07.py`;
AMX_FEW=0 / 1 alternate step by step, median of 40 each, outputs asserted equal
(docs/performance.md section 56)."""
import os, sys, time, numpy as np
sys.path.insert(0, "/work/main/docs/performance"); sys.path.insert(0, "/work/main")
from runner_steps import prefilled_runner, step_fns
ctx = 115
r, tables, rng = prefilled_runner("/work/main/cache/models/SmolLM2-135M-Instruct", 8, ctx)
for b, k in [(1, 1), (1, 4), (1, 8), (1, 16), (4, 1), (8, 1), (4, 4), (2, 4)]:
    fns, _ = step_fns({"r": (r, tables)}, rng.integers(0, 49152, (b, k)), ctx)
    f = fns["r"]
    for _ in range(4): f()
    ts = {"0": [], "1": []}; outs = {}
    for it in range(80):
        v = "10"[it % 2]; os.environ["AMX_FEW"] = v
        t0 = time.perf_counter(); o = f(); ts[v].append(time.perf_counter() - t0)
        outs[v] = np.asarray(o.tokens).tolist() if k == 1 else [np.asarray(o.accepted).tolist(), np.asarray(o.bonus).tolist()]
    assert outs["0"] == outs["1"]
    bb, aa = np.median(ts["0"]) * 1e3, np.median(ts["1"]) * 1e3
    print(f"{b}x{k}: before {bb:.2f} after {aa:.2f} ms ratio {aa/bb:.3f}", flush=True)
