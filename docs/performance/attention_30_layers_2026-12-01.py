"""docs/performance.md section 29: 30 layers of `prefix_block_attention` in one jit (9/3 heads, D = 64,
context 256): XLA, the whole-step kernel ("fused"), section 28's prefix kernel (its block part made
bfloat16 only to keep it off the whole-step kernel), one run, medians of 20.
    python docs/performance/attention_30_layers_2026-12-01.py BATCH K"""
import sys, time, numpy as np, jax, jax.numpy as jnp
from jax_backend import cpu_kernels
from jax_backend.paged_attention import prefix_block_attention
assert cpu_kernels.available()
rng = np.random.default_rng(0)
B, K, ctx, page = int(sys.argv[1]), int(sys.argv[2]), 256, 16
Hq, Hkv, D = 9, 3, 64
T = B * K
pages_per = ctx // page + 1
pool = jnp.asarray(rng.standard_normal((B * pages_per + 1, page, 2 * Hkv, D), dtype=np.float32))
pi = jnp.asarray(np.arange(1, B * pages_per + 1, dtype=np.int32).reshape(B, pages_per))
q = jnp.asarray(rng.standard_normal((T, Hq, D), dtype=np.float32))
k = jnp.asarray(rng.standard_normal((T, Hkv, D), dtype=np.float32)); v = k * 0.5
kv_lens = jnp.full((B,), ctx + K, jnp.int32); cu = jnp.arange(B + 1, dtype=jnp.int32) * K; ns = jnp.array([B], jnp.int32)
def make(kernel, kd=jnp.float32):
    kk, vv = k.astype(kd), v.astype(kd)
    @jax.jit
    def f(q):
        for _ in range(30):
            q = q + 1e-3 * prefix_block_attention(q, kk, vv, pool, kv_lens, pi, cu, ns, sm_scale=0.125, max_q_len=K, loop_to_longest=True, cpu_kernel=kernel).astype(q.dtype)
        return q
    return f
fs = {"xla": make(False), "fused": make(True), "prefix_kernel(bf16 block)": make(True, jnp.bfloat16), "xla(bf16 block)": make(False, jnp.bfloat16)}
for f in fs.values(): f(q).block_until_ready()
ts = {n: [] for n in fs}
for i in range(20):
    for n, f in fs.items():
        t = time.perf_counter(); f(q).block_until_ready(); ts[n].append(time.perf_counter() - t)
print(B, K, {n: round(1e3 * float(np.median(v)), 2) for n, v in ts.items()})
