"""The Q4_1 tile products at 3-16 rows, built two ways (`kernel_builds.run_builds`: one process per
build and round, builds alternating): us per product, 24 tiled copies of each weight cycled in one
jitted loop (dispatch amortized), both threads, fastest of 30 loops; outputs asserted equal across
builds. `PYTHONPATH=. python docs/performance/few_rows_products_2026-12-07.py "before:-DAMX_FEW_ROWS=0" "after:"`
(docs/performance.md section 56: separate processes read too far apart on this host; the in-process
A/B of few_rows_steps_2026-12-07.py decided)."""
import json, os, statistics, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import run_builds  # (this folder)
CODE = r'''
import json, sys, time, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "."); sys.path.insert(0, "tests/jax_backend")
from jax_backend import blocks, cpu_kernels
from test_gguf_blocks import random_blocks
assert cpu_kernels.amx_products()
rng = np.random.default_rng(0)
res = {}
for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
    stack = blocks.tile_q4(random_blocks(rng, (24, n, k), "Q4_1"))
    for rows in (3, 4, 8, 16):
        x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
        @jax.jit
        def loop(x, stack):
            def body(i, acc):
                return acc + cpu_kernels.rows_matmul_blocks(x + acc[:, :1] * 0, stack, i)
            return jax.lax.fori_loop(0, 24, body, jnp.zeros((rows, n), jnp.float32))
        out = loop(x, stack).block_until_ready()
        ts = []
        for _ in range(30):
            t0 = time.perf_counter(); loop(x, stack).block_until_ready(); ts.append(time.perf_counter() - t0)
        res[f"{n}x{k}@{rows}"] = {"us": float(np.min(ts) / 24 * 1e6), "out": float(np.asarray(out).sum())}
print(json.dumps(res))
'''
variants = [a for a in sys.argv[1:] if ":" in a]
runs = run_builds(CODE, variants, int(os.environ.get("ROUNDS", 3)))
names = list(runs)
for case in runs[names[0]][0]:
    assert len({r[case]["out"] for n in names for r in runs[n]}) == 1, f"{case}: outputs differ between builds"
    med = {n: statistics.median(r[case]["us"] for r in runs[n]) for n in names}
    print(case, {n: round(v, 1) for n, v in med.items()}, "ratio", {n: round(med[n] / med[names[0]], 3) for n in names[1:]}, flush=True)
