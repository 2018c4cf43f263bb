"""The blocks kernel (`rows_matmul_blocks`) alone, builds side by side (docs/performance.md section
50): Q4_1 SmolLM2 shapes (gate/up stack 3072 x 576, down 576 x 1536, q/k/v 960 x 576) and the Q8_0
lm_head (49152 x 576), env ROWS ("16 24 32"), COPIES (40 per weight cycled: from memory; 1: warm),
ROUNDS (2); one subprocess per build variant ("name:compiler flags", e.g. "before:-DBLOCKS_SCRATCH_ROWS=1000000"
"after:"), alternating by round; median ms per shape and rows, outputs asserted equal across builds."""
import os, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import run_builds  # (this folder)
code = r'''
import time, json, os
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
blk = jax.jit(cpu_kernels.rows_matmul_blocks)
def q41(n, k):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale, offset = ((rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32) for _ in range(2))
    return BlockWeights(jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(offset))
out = {}
def q80(n, k):
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    scale = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32)
    return BlockWeights(jnp.asarray(codes), jnp.asarray(scale), None)
for n, k in [(3072, 576), (576, 1536), (960, 576), (49152, 576)]:
    bw = [(q80 if n == 49152 else q41)(n, k) for _ in range(int(os.environ.get("COPIES", 40)) if n < 49152 else 3)]
    for rows in [int(r) for r in os.environ.get("ROWS", "16 24 32").split()]:
        x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, k), np.float32))
        it = iter(range(10**9))
        b = timed(lambda: blk(x, bw[next(it) % len(bw)]).block_until_ready(), 40)
        out[f"{n}x{k}@{rows}"] = round(b * 1e3, 4)
        out[f"sum{n}x{k}@{rows}"] = float(np.asarray(blk(x, bw[0])).sum())
print(json.dumps(out))
'''
runs = run_builds(code, sys.argv[1:], int(os.environ.get("ROUNDS", 2)))
import statistics
names = list(runs)
for key in runs[names[0]][0]:
    if key.startswith("sum"):
        assert len({r[key] for n in names for r in runs[n]}) == 1, key
        continue
    meds = {n: statistics.median(r[key] for r in runs[n]) for n in names}
    print(key, " ".join(f"{n} {v:.3f}" for n, v in meds.items()), " ratio", " ".join(f"{meds[n]/meds[names[0]]:.2f}" for n in names[1:]))
