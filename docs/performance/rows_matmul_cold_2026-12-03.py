"""Matmul kernel variants with weights from memory (distinct weights > the L3), one process, 5 interleaved passes,
medians; each variant built with its own -D flags under its own FFI name, outputs bit-identical (docs/performance.md
section 31c):

    ROWS=9,10,12,14,16,24,32 python docs/performance/rows_matmul_cold_2026-12-03.py "t46:" "t64:-DTILE=6,4,8" "t83:-DTILE=8,3,8"

A variant is label:flags, flags separated by ";". Measured before 13-16 rows got 6 x 4 tiles."""
import os, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
from kernel_variants import build, calling, parse
variants = parse(sys.argv[1:])
labels = [label for label, _ in variants]
names = build("rows_matmul.cc", "sgl_dflash_rows_matmul", [flags for _, flags in variants])
fn = lambda name: jax.jit(calling("MATMUL_TARGET", name, cpu_kernels.rows_matmul))
rng = np.random.default_rng(0)
ROWS = [int(r) for r in os.environ.get("ROWS", "1,4,8,12,16,32").split(",")]
for k, n, count in [(576, 1536, 180), (1536, 576, 180), (576, 49152, 6)]:
    ws = [jnp.asarray(rng.standard_normal((n, k), np.float32)) for _ in range(count)]
    for rows in ROWS:
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
        fs = {t: fn(nm) for t, nm in zip(labels, names)}
        outs = {t: np.asarray(f(x, ws[0])) for t, f in fs.items()}
        assert all(np.array_equal(o, outs[labels[0]]) for o in outs.values())
        times = {t: [] for t in labels}
        for rep in range(5):
            for t in (labels if rep % 2 else labels[::-1]):
                t0 = time.perf_counter()
                for w in ws: fs[t](x, w).block_until_ready()
                times[t].append((time.perf_counter() - t0) / len(ws))
        base = np.median(times[labels[0]])
        gbs = n * k * 4 / base / 1e9
        print(f"{k}x{n} r{rows}: " + "  ".join(f"{t} {1e3*np.median(v):.3f}ms ({np.median(v)/base:.2f})" for t, v in times.items()) + f"  [{gbs:.1f} GB/s base]", flush=True)
    del ws
