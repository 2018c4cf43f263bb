"""Kernel alone: rows_matmul_blocks (GGUF Q4_1 / Q8_0 blocks) against rows_matmul on the decoded
float32 weights, distinct weights cycled beyond the L3, outputs asserted bit-identical; argv: row
counts. `python docs/performance/gguf_blocks_kernel_2026-12-06.py 1 8 16 32`."""
import sys, time, collections
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
assert cpu_kernels.available()
BW = collections.namedtuple("BW", "codes scale offset")
rng = np.random.default_rng(0)
def q41(n, k):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    offset = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    c = codes.reshape(n, k // 32, 16)
    qs = np.concatenate([c & 15, c >> 4], axis=-1).astype(np.float32)  # [n, b, 32]
    w = (scale[..., None] * qs + offset[..., None]).reshape(n, k).astype(np.float32)
    return BW(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(offset)), jnp.asarray(w)
def q80(n, k):
    codes = rng.integers(-128, 128, (n, k), dtype=np.int8)
    scale = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    w = (scale[..., None] * codes.reshape(n, k // 32, 32).astype(np.float32)).reshape(n, k)
    return BW(jnp.asarray(codes.view(np.uint8)), jnp.asarray(scale), None), jnp.asarray(w)
fb = jax.jit(cpu_kernels.rows_matmul_blocks)
ff = jax.jit(cpu_kernels.rows_matmul)
for maker, k, n, count in [(q41, 576, 1536, 120), (q41, 1536, 576, 120), (q80, 576, 49152, 3)]:
    pairs = [maker(n, k) for _ in range(count)]
    for rows in [int(r) for r in sys.argv[1:]] or (1, 8, 32):
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
        a = np.asarray(fb(x, pairs[0][0])); b = np.asarray(ff(x, pairs[0][1]))
        assert (a == b).all(), np.abs(a - b).max()
        res = {}
        for rep in range(3):
            for name, f, j in (("f32", ff, 1), ("blocks", fb, 0)):
                t0 = time.perf_counter()
                reps = max(count, 60)
                for i in range(reps): f(x, pairs[i % count][j]).block_until_ready()
                res.setdefault(name, []).append((time.perf_counter() - t0) / reps)
        tf, tb = np.median(res["f32"]), np.median(res["blocks"])
        print(f"{maker.__name__} {k}x{n} rows {rows}: f32 {tf*1e3:.3f} ms  blocks {tb*1e3:.3f} ms  ratio {tb/tf:.2f}", flush=True)
