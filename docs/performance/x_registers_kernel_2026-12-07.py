"""Few-row GGUF/bfloat16 products (`rows_matmul_blocks` Q4_1, `rows_matmul` bf16) built two ways
(kernel_variants.py), each a jitted chain of 64 calls in which every call depends on the last
(XLA:CPU runs independent custom calls concurrently, so a chain of independent calls does not
time one call), builds interleaved, best of 9, outputs asserted bit-identical across builds.
`PYTHONPATH=. python docs/performance/x_registers_kernel_2026-12-07.py "before:-DX_FOLDED" "after:"`
(env ROWS, default "1 8 16"; docs/performance.md section 61). HEAD=1 adds the Q8_0 lm_head shape
(49152 x 576), as section 62 ran it on an AVX2 host:
`HEAD=1 ROWS="1 4 8 16" PYTHONPATH=. python docs/performance/x_registers_kernel_2026-12-07.py "before:-DAVX2_SCRATCH" "after:"`."""
import collections, os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
import kernel_variants as kv

assert cpu_kernels.available()
variants = kv.parse(sys.argv[1:])
blocks = kv.build("rows_matmul.cc", "sgl_dflash_rows_matmul_blocks", [f for _, f in variants])
bf16 = kv.build("rows_matmul.cc", "sgl_dflash_rows_matmul_bf16", [f for _, f in variants])
BW = collections.namedtuple("BW", "codes scale offset")
rng = np.random.default_rng(0)
CALLS = 64


def q41(n, k):
    return BW(jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8)),
              jnp.asarray((rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32)),
              jnp.asarray((rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32)))


def q80(n, k):
    return BW(jnp.asarray(rng.integers(0, 256, (n, k), dtype=np.uint8)),
              jnp.asarray((rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32)),
              jnp.zeros((n, k // 32), np.float32))


def chain(f, rows, n):
    def many(x, w):
        xi = x[0]
        for i in range(CALLS):
            xi = x[i] + f(xi, w)[:, :1] * 1e-30
        return xi
    return jax.jit(many)


for rows in [int(r) for r in os.environ.get("ROWS", "1 8 16").split()]:
    shapes = [("q41", 3072, 576), ("q41", 960, 576), ("q41", 576, 1536), ("q41", 576, 576),
              ("bf16", 3072, 576), ("bf16", 576, 1536)]
    for kind, n, k in [("q80", 49152, 576)] * (os.environ.get("HEAD") == "1") + shapes:
        w = {"q41": q41, "q80": q80}[kind](n, k) if kind != "bf16" else jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
        names, target, fn = (blocks, "BLOCKS_TARGET", cpu_kernels.rows_matmul_blocks) if kind != "bf16" else \
            (bf16, "BF16_TARGET", cpu_kernels.rows_matmul)
        x = jnp.asarray(rng.standard_normal((CALLS, rows, k), np.float32))
        fns = [chain(kv.calling(target, name, fn), rows, n) for name in names]
        outs = [np.asarray(f(x, w)) for f in fns]
        assert all((o == outs[0]).all() for o in outs), "bits differ between builds"
        best = [1e9] * len(fns)
        for _ in range(9):
            for i, f in enumerate(fns):
                t = time.perf_counter()
                f(x, w).block_until_ready()
                best[i] = min(best[i], (time.perf_counter() - t) / CALLS)
        print(f"{kind} {rows:2d} rows {n}x{k}: " + "  ".join(
            f"{label} {b * 1e3:.4f} ms ({2 * rows * n * k / b / 1e9:.0f} GFLOP/s, {b / best[0]:.3f})"
            for (label, _), b in zip(variants, best)), flush=True)
