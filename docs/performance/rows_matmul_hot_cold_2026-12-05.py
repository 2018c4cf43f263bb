import os, sys, time
sys.path.insert(0, "docs/performance")
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
assert cpu_kernels.available()
f = jax.jit(cpu_kernels.rows_matmul)
rng = np.random.default_rng(0)
for k, n, count in [(576, 1536, 180), (576, 1536, 1), (576, 384, 1), (576, 384, 720)]:
    ws = [jnp.asarray(rng.standard_normal((n, k), np.float32)) for _ in range(count)]
    for rows in (1, 2, 4, 8, 16):
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
        f(x, ws[0]).block_until_ready()
        ts = []
        for rep in range(5):
            t0 = time.perf_counter()
            for i in range(max(count, 200)): f(x, ws[i % count]).block_until_ready()
            ts.append((time.perf_counter() - t0) / max(count, 200))
        t = np.median(ts)
        print(f"{k}x{n} x{count} r{rows}: {t*1e3:.3f} ms  {2*rows*k*n/t/1e9:.1f} GFLOP/s  {n*k*4/t/1e9:.1f} GB/s", flush=True)
