"""Kernel alone: rows_matmul on bfloat16 weights, the FMA kernel vs AMX tiles (bf16_tiled, weights in bf16_tile_order), drafter shapes, L copies cycled (env L, default 24) in one jitted loop; args: row counts (docs/performance.md section 55)."""
import time, sys, numpy as np, jax, jax.numpy as jnp
from jax_backend import cpu_kernels
assert cpu_kernels.available(), "no kernels"
rng = np.random.default_rng(0)
import os; L = int(os.environ.get("L", 24))
shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536), (576, 2880)]
rows = [int(r) for r in sys.argv[1:]] or [2, 4, 8, 16, 32, 64]
for (N, K) in shapes:
    w = jnp.asarray(rng.standard_normal((L, N, K)).astype(np.float32) * 0.05, jnp.bfloat16); wt = cpu_kernels.bf16_tile_order(w)
    for R in rows:
        x = jnp.asarray(rng.standard_normal((R, K)).astype(np.float32))
        res = {}
        for tiles in (False, True):
            def body(i, acc, t=tiles):
                return acc + cpu_kernels.rows_matmul(x + acc[:, :1] * 0, wt if t else w, i % L, bf16_tiled=t)
            f = jax.jit(lambda x, w: jax.lax.fori_loop(0, 24, body, jnp.zeros((R, N), jnp.float32)))
            f(x, w).block_until_ready()
            ts = []
            for rep in range(7):
                t0 = time.perf_counter(); f(x, w).block_until_ready(); ts.append((time.perf_counter() - t0) / 24)
            res[tiles] = np.median(ts) * 1e3
        y = [np.asarray(jax.jit(lambda x, w, t=t: cpu_kernels.rows_matmul(x, w, 0, bf16_tiled=t))(x, wt if t else w)) for t in (False, True)]
        ref = np.asarray(x, np.float64) @ np.asarray(w[0].astype(jnp.float32), np.float64).T
        print(f"{N}x{K} R={R}: fma {res[False]*1e3:.1f} us  tiles {res[True]*1e3:.1f} us  ratio {res[True]/res[False]:.2f}  err fma {np.abs(y[0]-ref).max():.1e} tiles {np.abs(y[1]-ref).max():.1e}", flush=True)
