"""A/B in one process (docs/performance.md section 30): the real SmolLM2's decode and verify
forwards (context 256, both layer layouts) with the matmul kernel of an earlier commit (built
from `git show COMMIT:jax_backend/cpu_kernels/rows_matmul.cc` under another FFI name) against the
working tree's, interleaved; medians of wall ms; the outputs must be bit-identical (every output
is the same fixed-order sum in both kernels).

    python docs/performance/rows_matmul_tiles_ab_2026-12-02.py COMMIT|worktree REPEATS B:K [B:K ...]"""
import ctypes, json, subprocess, sys, tempfile, time
from pathlib import Path
import jax, numpy as np
from jax_backend import cpu_kernels, model
from jax_backend.batch import SeqInput
from jax_backend.runner import TargetRunner

MODEL, ctx = "cache/models/SmolLM2-135M-Instruct", 256
commit, reps = sys.argv[1], int(sys.argv[2])
cases = [tuple(int(x) for x in c.split(":")) for c in sys.argv[3:]]
assert cpu_kernels.available()
kernels = Path(cpu_kernels.__file__).parent
old_src = ((kernels / "rows_matmul.cc").read_text() if commit == "worktree" else  # an A/A check of the method
           subprocess.run(["git", "show", f"{commit}:jax_backend/cpu_kernels/rows_matmul.cc"], capture_output=True,
                          text=True, check=True).stdout).replace("sgl_dflash_rows_matmul", "old_rows_matmul")
tmp = Path(tempfile.mkdtemp())
(tmp / "rows_matmul.cc").write_text(old_src)
(tmp / "common.h").write_text((kernels / "common.h").read_text())
subprocess.run(["g++", *cpu_kernels.FLAGS, "-I", jax.ffi.include_dir(), str(tmp / "rows_matmul.cc"), "-o", str(tmp / "old.so")], check=True)
library = ctypes.CDLL(str(tmp / "old.so"))
jax.ffi.register_ffi_target("old_rows_matmul", jax.ffi.pycapsule(library.old_rows_matmul), platform="cpu")

max_b = max(b for b, _ in cases)
r = TargetRunner(MODEL, max_total_tokens=max_b * (ctx + 64), max_num_seqs=max_b, max_model_len=ctx + 32,
                 aux_layer_ids=(1, 8, 14, 20, 27), layer_loop="auto")
rng = np.random.default_rng(0)
tables = [r.allocator.allocate(i, ctx + 32) for i in range(max_b)]
for i in range(max_b):
    r.forward([SeqInput(rng.integers(100, 40000, ctx).tolist(), 0, tables[i])])


def program(target, params, batch):
    cpu_kernels.MATMUL_TARGET = target  # read while tracing
    f = jax.jit(lambda p, pool, b: model.forward(p, r.config, pool, b, r.aux_layer_ids)[0])
    out = f(params, r.kv_pool, batch).block_until_ready()
    cpu_kernels.MATMUL_TARGET = "sgl_dflash_rows_matmul"
    return f, np.asarray(out)


rows = []
for b, k in cases:
    seqs = [SeqInput(rng.integers(100, 40000, k).tolist(), ctx, tables[j], "all") for j in range(b)]
    batch, _ = r._batch(seqs)
    for layout, params in (("scan", r._step_params), ("switch", r._switch_params)):
        fs = {}
        for name, target in (("old", "old_rows_matmul"), ("new", "sgl_dflash_rows_matmul")):
            fs[name] = program(target, params, batch)
        times = {n: [] for n in fs}
        for i in range(reps):
            for name in (list(fs) if i % 2 else list(fs)[::-1]):
                t0 = time.perf_counter()
                fs[name][0](params, r.kv_pool, batch).block_until_ready()
                times[name].append(time.perf_counter() - t0)
        med = {n: 1e3 * float(np.median(ts[reps // 4:])) for n, ts in times.items()}
        row = dict(batch=b, k=k, layout=layout, old_ms=med["old"], new_ms=med["new"], ratio=med["new"] / med["old"],
                   bit_identical=bool(np.array_equal(fs["old"][1], fs["new"][1])))
        rows.append(row)
        print(json.dumps(row), flush=True)
Path(__file__).with_suffix(".json").write_text(json.dumps(dict(commit=commit, context=ctx, repeats=reps, rows=rows), indent=1))
