"""A/B in one process (docs/performance.md section 29): TargetRunner.verify blocks of the real
SmolLM2 with and without the CPU matmul kernel, interleaved; medians of wall ms.

    python docs/performance/cpu_matmul_verify_ab_2026-12-01.py BATCH K CONTEXT REPEATS"""
import sys, time, numpy as np
from jax_backend.batch import SeqInput
from jax_backend.runner import TargetRunner

MODEL = "cache/models/SmolLM2-135M-Instruct"
B, K, ctx, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 40000, ctx).tolist() for _ in range(B)]
tokens = rng.integers(100, 40000, (B, K))
runs = {}
for flag in (False, True):
    r = TargetRunner(MODEL, max_total_tokens=B * (ctx + 64), max_num_seqs=B, max_model_len=ctx + 32,
                     aux_layer_ids=(1, 10, 18, 27), cpu_matmul=flag)
    tables = [r.allocator.allocate(i, ctx + 32) for i in range(B)]
    r.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    seqs = [SeqInput(t.tolist(), ctx, tables[i], "all") for i, t in enumerate(tokens)]
    runs[flag] = (r, seqs)
times = {False: [], True: []}
outs = {}
for i in range(reps):
    for flag in ((False, True) if i % 2 else (True, False)):
        r, seqs = runs[flag]
        t0 = time.perf_counter(); out = r.verify(seqs); times[flag].append(time.perf_counter() - t0)
        outs[flag] = (out.accepted.tolist(), out.bonus.tolist())
w = reps // 3
m = {f: 1e3 * np.median(times[f][w:]) for f in times}
print(f"B={B} K={K} ctx={ctx}: xla {m[False]:.2f} ms, kernel {m[True]:.2f} ms, ratio {m[True]/m[False]:.3f}, same {outs[False]==outs[True]}")
