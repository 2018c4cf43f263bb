"""The baseline of amx_products_proto_2026-12-07.cc: rows_matmul_blocks on random Q4_1 blocks of the same shapes (40 copies cycled), through jax.jit (its dispatch included), both threads."""
import sys, time, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from jax_backend import cpu_kernels
from tests.jax_backend.test_gguf_blocks import random_blocks
assert cpu_kernels.available()
rng = np.random.default_rng(0)
for N in (3072, 576):
    ws = [random_blocks(rng, (N, 576), "Q4_1") for _ in range(40)]
    f = jax.jit(cpu_kernels.rows_matmul_blocks)
    for R in (1, 8, 16, 32, 64):
        x = jnp.asarray(rng.standard_normal((R, 576)).astype(np.float32))
        for w in ws[:3]: f(x, w).block_until_ready()
        ts = []
        for it in range(200):
            t0 = time.perf_counter(); f(x, ws[it % 40]).block_until_ready(); ts.append(time.perf_counter() - t0)
        ms = np.median(ts) * 1e3
        print(f"N {N} R {R:2d}: rows_matmul_blocks {ms:.3f} ms ({2*R*N*576/ms/1e6:.0f} GFLOP/s)", flush=True)
