"""The drafter's propose with the bf16 tile products' small-product rule on and off IN ONE PROCESS:
apply drafter_small_split_toggle_2026-12-07.diff (a temporary getenv switch, not kept), then
`MODEL=cache/models/SmolLM2-135M-Instruct WORKER=1 TILES=1 python
docs/performance/drafter_small_split_propose_2026-12-07.py n ctx block`; BF16_SPLIT_ALL set /
unset alternate call by call (greedy propose; and commit + propose with confidences, the adaptive
path), median of 120 each, the greedy propose's drafts asserted equal (docs/performance.md section 57)."""
import os, sys, time, numpy as np, jax
code = open(__file__.replace("drafter_small_split_propose_2026-12-07", "drafter_head_major_propose_ab_2026-12-05")).read()
code = code.split("CODE = r'''")[1].split("'''")[0].split("for _ in range(5): step()")[0]
exec(code.replace("few_row_matmul=cpu_kernels.rows_matmul,", "few_row_matmul=__import__('functools').partial("
                  "cpu_kernels.rows_matmul, bf16_tiled=True), narrow_layout=cpu_kernels.bf16_tile_order,"))
for label, fn in (("greedy propose", lambda: p.propose(ids, bonus, block_size=block)), ("commit + propose with confidences", step)):
    for _ in range(10): fn()
    ts, outs = {"old": [], "new": []}, {}
    for it in range(240):
        v = ("old", "new")[it % 2]
        if v == "old": os.environ["BF16_SPLIT_ALL"] = "1"
        else: os.environ.pop("BF16_SPLIT_ALL", None)
        t0 = time.perf_counter(); out = jax.block_until_ready(fn()); ts[v].append(time.perf_counter() - t0)
        outs[v] = np.asarray(out[0] if isinstance(out, tuple) else out).tolist()
    os.environ.pop("BF16_SPLIT_ALL", None)
    if fn is not step:  # (each step commits: its context grows, so its drafts move on)
        assert outs["old"] == outs["new"]
    o, nw = np.median(ts["old"]) * 1e3, np.median(ts["new"]) * 1e3
    print(f"{label} {n}x{ctx}x{block}: split all {o:.3f} ms, small products on one thread {nw:.3f} ms, ratio {nw / o:.3f}", flush=True)
