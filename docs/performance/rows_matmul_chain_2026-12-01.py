"""docs/performance.md section 29: the 30 layers' projection shapes of SmolLM2 (+ lm_head) chained in one jit,
the CPU matmul kernel against XLA's dots (the out-major orientation `model.project` used), and the
kernel against a float64 reference.  python docs/performance/rows_matmul_chain_2026-12-01.py"""
import time, jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
assert cpu_kernels.available()
rng = np.random.default_rng(0)
for R, K, N in [(1, 576, 576), (3, 576, 192), (8, 576, 1536), (7, 1536, 576), (5, 100, 37), (32, 576, 49152)]:
    x = rng.standard_normal((R, K), dtype=np.float32); w = rng.standard_normal((3, N, K), dtype=np.float32)
    y = jax.jit(lambda x, w, i: cpu_kernels.rows_matmul(x, w, i))(x, w, 2)
    ref = x.astype(np.float64) @ w[2].T.astype(np.float64)
    y1 = np.stack([np.asarray(cpu_kernels.rows_matmul(x[r:r+1], w[2])) [0] for r in range(R)])
    print(R, K, N, float(np.abs(np.asarray(y) - ref).max()), "rows bit-equal:", bool((np.asarray(y) == y1).all()))
L = 30
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = [jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.01) for l in range(L) for s in shapes]
head = jnp.asarray(rng.standard_normal((49152, 576), dtype=np.float32) * 0.01)
def proj_xla(w_t, x):
    return jax.lax.optimization_barrier(w_t @ x.T).T if x.shape[0] > 1 else x @ w_t.T
def make(proj):
    @jax.jit
    def f(ws, head, x):
        for i in range(L):
            q = proj(ws[4*i], x); x = x + proj(ws[4*i+1], q[:, :576])
            g = proj(ws[4*i+2], x); x = x + proj(ws[4*i+3], g[:, :1536])
        return proj(head, x)
    return f
fx, fk = make(proj_xla), make(lambda w, x: cpu_kernels.rows_matmul(x, w))
for R in [1, 2, 4, 8, 16, 32, 64]:
    x = jnp.ones((R, 576), jnp.float32) * 0.1
    t = {}
    for name, f in (("xla", fx), ("kernel", fk)):
        f(ws, head, x).block_until_ready()
    for name, f in (("xla", fx), ("kernel", fk)) * 5:
        s = time.perf_counter(); f(ws, head, x).block_until_ready(); d = time.perf_counter() - s
        t[name] = min(t.get(name, 1e9), d)
    print(f"R={R:2d} xla {t['xla']*1e3:7.2f} kernel {t['kernel']*1e3:7.2f} ratio {t['kernel']/t['xla']:.2f}")
