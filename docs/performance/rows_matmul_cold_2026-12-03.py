"""Matmul kernel variants with weights from memory (distinct weights > the L3), one process, 5 interleaved passes,
medians; each variant built with its own -D flags under its own FFI name, outputs bit-identical (docs/performance.md
section 31c):

    ROWS=9,10,12,14,16,24,32 python docs/performance/rows_matmul_cold_2026-12-03.py "t46:" "t64:-DTILE=6,4,8" "t83:-DTILE=8,3,8"

A variant is label:flags, flags separated by ";". Measured before 13-16 rows got 6 x 4 tiles."""
import ctypes, subprocess, sys, time, tempfile
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
src = Path(cpu_kernels.__file__).parent
variants = [v.split(":") for v in sys.argv[1:]]  # name:flags(comma sep)
tmp = Path(tempfile.mkdtemp()); (tmp / "common.h").write_text((src / "common.h").read_text())
names = []
for i, (label, flags) in enumerate(variants):
    name = f"mm_{i}"
    (tmp / f"{name}.cc").write_text((src / "rows_matmul.cc").read_text().replace("sgl_dflash_rows_matmul", name))
    extra = [f for f in flags.split(";") if f]
    subprocess.run(["g++", *cpu_kernels.FLAGS, "-w", *extra, "-I", jax.ffi.include_dir(), str(tmp / f"{name}.cc"), "-o", str(tmp / f"{name}.so")], check=True)
    lib = ctypes.CDLL(str(tmp / f"{name}.so"))
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    names.append(name)
def fn(name):
    def f(x, w):
        cpu_kernels.MATMUL_TARGET = name
        try: return cpu_kernels.rows_matmul(x, w)
        finally: cpu_kernels.MATMUL_TARGET = "sgl_dflash_rows_matmul"
    return jax.jit(f)
rng = np.random.default_rng(0)
labels = [v[0] for v in variants]
import os; ROWS = [int(r) for r in os.environ.get("ROWS", "1,4,8,12,16,32").split(",")]
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
