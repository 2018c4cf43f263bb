"""The CPU kernels of a commit against the working tree's, each built for this CPU and for AVX2
(`-mno-avx512f`) (docs/performance.md section 31): per build, how many of its FMAs read an operand
from the stack (accumulators the compiler kept in memory), and in a process of its own, wall ms of
the matmul kernel beside XLA's dot on SmolLM2's shapes and of the whole-step attention kernel.

    python docs/performance/kernel_builds_ab_2026-12-02.py COMMIT [REPEATS]

Writes the JSON beside this file. Processes differ by up to 1.5x here (memory placement), so
compare ratios to XLA within a process, and kernel ms across processes only where they differ more."""
import json, os, subprocess, sys, tempfile
from pathlib import Path

import jax

from jax_backend import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("common.h", "rows_matmul.cc", "paged_attention.cc")

TIMING = r"""
import functools, json, pathlib, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
from jax_backend.paged_attention import CPU_KERNEL_MAX_Q_LEN, prefix_block_attention
from tests.jax_backend.test_paged_attention import pack_specs
cpu_kernels.build = lambda: pathlib.Path(sys.argv[1])
assert cpu_kernels.available()
reps, rng, out = int(sys.argv[2]), np.random.default_rng(0), []

def best_ms(fn, inputs):
    for a in inputs: fn(*a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for a in inputs: fn(*a).block_until_ready()
        best = min(best, (time.perf_counter() - t0) / len(inputs))
    return 1e3 * best

kernel, xla = jax.jit(cpu_kernels.rows_matmul), jax.jit(lambda x, w: x @ w.T)
for k, n in [(576, 1536), (1536, 576), (576, 49152)]:
    weights = [jnp.asarray(rng.standard_normal((n, k), np.float32)) for _ in range(1 if n > 10000 else 6)]
    for rows in [1, 4, 8, 16, 32]:
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
        ms = {name: best_ms(fn, [(x, w) for w in weights]) for name, fn in (("kernel", kernel), ("xla", xla))}
        out.append(dict(op="matmul", k=k, n=n, rows=rows, kernel_ms=ms["kernel"], xla_ms=ms["xla"]))
for seqs, q_len, ctx in [(1, 1, 512), (1, 8, 512), (1, 16, 512), (32, 1, 256)]:
    heads, kv_heads, dim, page = 9, 3, 64, 16
    pages_per_seq = (ctx + q_len) // page + 1
    pool = rng.standard_normal((seqs * pages_per_seq + 1, page, 2 * kv_heads, dim), np.float32)
    specs = [(q_len, ctx + q_len)] * seqs
    tables = pack_specs(specs, np.arange(1, seqs * pages_per_seq + 1), np.zeros(seqs, np.int32), pages_per_seq, page)
    page_indices, kv_lens, cu_q_lens = tables
    t = seqs * q_len
    args = [jnp.asarray(a) for a in (rng.standard_normal((t, heads, dim), np.float32),
            rng.standard_normal((t, kv_heads, dim), np.float32), rng.standard_normal((t, kv_heads, dim), np.float32),
            pool, kv_lens, page_indices, cu_q_lens, np.array([seqs], np.int32))]
    attend = jax.jit(functools.partial(prefix_block_attention, sm_scale=dim**-0.5, max_q_len=CPU_KERNEL_MAX_Q_LEN,
                                       chunk_tokens=max(t, 16), loop_to_longest=True, cpu_kernel=True))
    out.append(dict(op="attention", seqs=seqs, q_len=q_len, context=ctx, kernel_ms=best_ms(attend, [args])))
print(json.dumps(out))
"""


def sources(commit: str, into: Path) -> None:
    into.mkdir(parents=True)
    for name in NAMES:
        text = ((ROOT / "jax_backend/cpu_kernels" / name).read_text() if commit == "worktree" else
                subprocess.run(["git", "show", f"{commit}:jax_backend/cpu_kernels/{name}"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout)
        (into / name).write_text(text)


def main() -> None:
    commit, reps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7
    tmp, results = Path(tempfile.mkdtemp()), []
    for source in (commit, "worktree"):
        sources(source, tmp / source)
        for isa, extra in (("native", []), ("avx2", ["-mno-avx512f"])):
            src, lib = tmp / source, tmp / f"{source}-{isa}.so"
            flags = [*cpu_kernels.FLAGS, *extra, "-w", "-I", jax.ffi.include_dir()]
            subprocess.run(["g++", *flags, str(src / "paged_attention.cc"), str(src / "rows_matmul.cc"), "-o", str(lib)],
                           check=True)
            spilled = {}
            for name in ("rows_matmul.cc", "paged_attention.cc"):
                asm = subprocess.run(["g++", *[f for f in flags if f not in ("-shared", "-fPIC")], "-S", "-o", "-",
                                      str(src / name)], capture_output=True, text=True, check=True).stdout
                fmas = [line for line in asm.splitlines() if "vfmadd" in line]
                spilled[name] = dict(fmas=len(fmas), stack_operand=sum("(%rsp)" in f or "(%rbp)" in f for f in fmas))
            done = subprocess.run([sys.executable, "-c", TIMING, str(lib), str(reps)], cwd=ROOT, capture_output=True,
                                  text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            row = dict(source=source, isa=isa, fma=spilled, timings=json.loads(done.stdout.splitlines()[-1]))
            results.append(row)
            print(source, isa, json.dumps(spilled), flush=True)
            for t in row["timings"]:
                print("   ", json.dumps(t), flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(dict(commit=commit, repeats=reps, runs=results), indent=1))


if __name__ == "__main__":
    main()
