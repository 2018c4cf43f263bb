"""Kernel builds side by side (docs/performance.md section 47): `rows_matmul` with cold weights
(copies cycled past the L3) in one subprocess per build variant, variants alternating by round;
median ms per shape and its ratio to the first variant. argv: "name:compiler flags" per variant
(SGL_DFLASH_KERNEL_FLAGS), e.g. "off:-DPREFETCH_AHEAD=0,0,0" "on:". env SHAPES: a Python list of
(kind, maker, N, K, rows) with makers f32 / bf / q80 / q41; ROUNDS (2). The section's hint variants
were a temporary macro in place of the prefetch's locality argument (now 2 everywhere)."""
import os, sys, json
from kernel_builds import run_builds  # (this folder)
variants = sys.argv[1:]  # "name:flags"
code = r'''
import time, jax, jax.numpy as jnp, numpy as np, json, os
from jax_backend import cpu_kernels
from jax_backend.blocks import BlockWeights
assert cpu_kernels.available()
rng = np.random.default_rng(0)
k = jax.jit(cpu_kernels.rows_matmul)
def timed(fn, reps):
    fn(0); runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(reps): fn(i)
        runs.append((time.perf_counter() - t0) / reps)
    return float(np.median(runs))
def q41(n, kk):
    return BlockWeights(jnp.asarray(rng.integers(0, 256, (n, kk // 2), dtype=np.uint8)), jnp.asarray((rng.standard_normal((n, kk // 32)) * 0.01).astype(np.float32)), jnp.asarray((rng.standard_normal((n, kk // 32)) * 0.01).astype(np.float32)))
def q80(n, kk):
    return BlockWeights(jnp.asarray(rng.integers(-128, 128, (n, kk), dtype=np.int8).view(np.uint8)), jnp.asarray((rng.standard_normal((n, kk // 32)) * 0.01).astype(np.float32)), None)
f32 = lambda n, kk: jnp.asarray(rng.standard_normal((n, kk)), jnp.float32)
bf = lambda n, kk: jnp.asarray(rng.standard_normal((n, kk)), jnp.bfloat16)
res = {}
for kind, mk, n, kk, rowsl in eval(os.environ.get("SHAPES", '[("bf16", bf, 1536, 576, (4, 8)), ("q8", q80, 49152, 576, (8, 16))]')):
    copies = max(2, int(40e6 / (n * kk)))
    ws = [mk(n, kk) for _ in range(copies)]
    for rows in rowsl:
        x = jnp.asarray(rng.standard_normal((rows, kk)), jnp.float32)
        reps = max(5, int(2e8 / (n * kk * rows)))
        res[f"{kind} {n}x{kk} r{rows}"] = round(timed(lambda i: k(x, ws[i % len(ws)]).block_until_ready(), reps) * 1e3, 4)
print(json.dumps(res))
'''
runs = run_builds(code, variants, int(os.environ.get("ROUNDS", 2)))
out = {}  # shape -> variant -> ms per round
for name, results in runs.items():
    for res in results:
        for key, val in res.items(): out.setdefault(key, {}).setdefault(name, []).append(val)
for key, d in out.items():
    base = sorted(d[variants[0].split(":")[0]])
    print(f"{key:24s}", "  ".join(f"{n}: {sorted(v)[len(v)//2]:.3f} ({sorted(v)[len(v)//2]/base[len(base)//2]:.2f})" for n, v in d.items()))
