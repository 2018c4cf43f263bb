"""The blocks kernel (GGUF Q4_1) against the float32 kernel at 8-64 rows, weights from memory (40 copies cycled), SmolLM2's q/k/v-gate/up stack and down shapes (docs/performance.md section 49). `PYTHONPATH=. python docs/performance/blocks_wide_rows_2026-12-06.py`"""
import time
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
from jax_backend.blocks import BlockWeights
assert cpu_kernels.available()
rng = np.random.default_rng(0)
def timed(fn, reps):
    fn(); runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps): fn()
        runs.append((time.perf_counter() - t0) / reps)
    return float(np.median(runs))
f32 = jax.jit(cpu_kernels.rows_matmul); blk = jax.jit(cpu_kernels.rows_matmul_blocks)
def q41(n, k):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale, offset = ((rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32) for _ in range(2))
    return BlockWeights(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(offset))
for n, k in [(3072, 576), (576, 1536)]:
    fw = [jnp.asarray(rng.standard_normal((n, k), np.float32)) for _ in range(40)]
    bw = [q41(n, k) for _ in range(40)]
    for rows in (8, 16, 24, 32, 64):
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
        it = iter(range(10**9))
        a = timed(lambda: f32(x, fw[next(it) % 40]).block_until_ready(), 40)
        b = timed(lambda: blk(x, bw[next(it) % 40]).block_until_ready(), 40)
        g = lambda s: 2 * n * k * rows / s / 1e9
        print(f"{n}x{k} rows {rows}: float32 cold {a*1e3:.3f} ms ({g(a):.0f} GF/s), q4_1 cold {b*1e3:.3f} ms ({g(b):.0f} GF/s), q41/f32 {b/a:.2f}", flush=True)
