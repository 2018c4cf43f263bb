"""The attention kernel (`ragged_attention`) alone, builds side by side (docs/performance.md section
47): S sequences of CTX cached keys and Q queries each, 30 pools cycled (cold, as the 30 layers of a
step), one subprocess per build variant, variants alternating by round; ms per call and a checksum of
the output (equal across builds). argv: "name:compiler flags"; env S (32), Q (1), CTX (180), ROUNDS (4).
The section's variants were a temporary macro in place of the K/V prefetch's locality (now 2)."""
import os, sys, json
from kernel_builds import run_builds  # (this folder)
variants = sys.argv[1:]
code = r'''
import time, jax, jax.numpy as jnp, numpy as np, json
from jax_backend import cpu_kernels
assert cpu_kernels.available()
rng = np.random.default_rng(0)
import os
S, ctx, P, Hkv, G, D = int(os.environ.get('S', 32)), int(os.environ.get('CTX', 180)), 16, 3, 3, 64
Q = int(os.environ.get('Q', 1))
width = (ctx + P) // P + 1
pages = S * width
layers = 30
pools = [jnp.asarray(rng.standard_normal((pages, P, 2 * Hkv, D)), jnp.float32) for _ in range(layers)]
pi = jnp.asarray(rng.permutation(pages).reshape(S, width).astype(np.int32))
q = jnp.asarray(rng.standard_normal((S * Q, Hkv * G, D)), jnp.float32)
nk = jnp.asarray(rng.standard_normal((S * Q, Hkv, D)), jnp.float32)
kvl = jnp.full((S,), ctx + Q, jnp.int32); cu = jnp.arange(S + 1, dtype=jnp.int32) * Q; ns = jnp.asarray([S], jnp.int32)
f = jax.jit(lambda q, pool: cpu_kernels.ragged_attention(q, nk, nk, pool, kvl, pi, cu, ns, sm_scale=0.125, mask_value=-1e30))
f(q, pools[0]).block_until_ready()
calls = 300 if S * ctx < 2000 else 60
runs = []
for _ in range(7):
    t0 = time.perf_counter()
    for i in range(calls): f(q, pools[i % layers]).block_until_ready()
    runs.append((time.perf_counter() - t0) / calls)
print(json.dumps({"ms": float(np.median(runs)) * 1e3, "sum": float(np.asarray(f(q, pools[0])).sum())}))
'''
runs = run_builds(code, variants, int(os.environ.get("ROUNDS", 4)))
print({name: [(round(d["ms"], 3), d["sum"]) for d in results] for name, results in runs.items()})
