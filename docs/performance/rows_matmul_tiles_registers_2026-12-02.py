"""Register tiles of the matmul kernel A/B in one process (docs/performance.md section 31b): each built with
-DTILE=rows,outputs,one_row_outputs under its own FFI name, interleaved medians, outputs bit-identical.
Measured before 2-8 rows got their fixed 8 x 3 tiles; since then -DTILE sets the other row counts' tiles.

    python docs/performance/rows_matmul_tiles_registers_2026-12-02.py 4,6,8 8,3,8 6,4,8"""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
from kernel_variants import build, calling
tiles = sys.argv[1:]  # e.g. 4,6,8 8,3,8
names = build("rows_matmul.cc", "sgl_dflash_rows_matmul", [[f"-DTILE={t}"] for t in tiles])
fn = lambda name: jax.jit(calling("MATMUL_TARGET", name, cpu_kernels.rows_matmul))
rng = np.random.default_rng(0)
for k, n in [(576, 1536), (1536, 576), (576, 960), (576, 49152)]:
    ws = [jnp.asarray(rng.standard_normal((n, k), np.float32)) for _ in range(1 if n > 10000 else 8)]
    for rows in [1, 4, 8, 16, 32]:
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
        fs = {t: fn(nm) for t, nm in zip(tiles, names)}
        outs = {t: np.asarray(f(x, ws[0])) for t, f in fs.items()}
        assert all(np.array_equal(o, outs[tiles[0]]) for o in outs.values())
        times = {t: [] for t in tiles}
        for rep in range(9):
            for t in (tiles if rep % 2 else tiles[::-1]):
                t0 = time.perf_counter()
                for w in ws * (1 if n > 10000 else 2): fs[t](x, w).block_until_ready()
                times[t].append((time.perf_counter() - t0) / (len(ws) * (1 if n > 10000 else 2)))
        base = np.median(times[tiles[0]])
        print(f"{k}x{n} r{rows}: " + "  ".join(f"{t} {1e3*np.median(v):.3f}ms ({np.median(v)/base:.2f})" for t, v in times.items()), flush=True)
