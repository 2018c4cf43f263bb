"""A/B in one process (docs/performance.md section 29): TargetRunner greedy decode steps of the
real SmolLM2 with and without the CPU matmul kernel, stepping in turn; medians of wall ms.

    python docs/performance/cpu_matmul_decode_ab_2026-12-01.py CONTEXT STEPS BATCHES  (e.g. 256 80 1,4,32)"""
import json, sys, time
import numpy as np
from jax_backend.batch import SeqInput
from jax_backend.runner import TargetRunner

MODEL = "cache/models/SmolLM2-135M-Instruct"
ctx, steps = int(sys.argv[1]), int(sys.argv[2])
batches = [int(b) for b in sys.argv[3].split(",")]
rng = np.random.default_rng(0)
results = {}
runners = {flag: TargetRunner(MODEL, max_total_tokens=max(batches) * (ctx + steps + 40), max_num_seqs=max(batches),
                              max_model_len=ctx + steps + 8, aux_layer_ids=(1, 15, 28), cpu_matmul=flag)
           for flag in (False, True)}
for B in batches:
    prompts = [rng.integers(100, 40000, ctx).tolist() for _ in range(B)]
    state = {}
    for flag, r in runners.items():
        tables = [r.allocator.allocate((B, i), ctx + steps + 2) for i in range(B)]
        first = r.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
        state[flag] = (tables, [[int(l[0].argmax())] for l in first.logits])
    times = {False: [], True: []}
    for step in range(steps):
        for flag in ((False, True) if step % 2 else (True, False)):
            r, (tables, toks) = runners[flag], state[flag]
            seqs = [SeqInput([t[-1]], ctx + step, tab) for t, tab in zip(toks, tables)]
            t0 = time.perf_counter()
            out = r.sample(seqs, [0.0] * B, [1.0] * B, [0] * B)
            times[flag].append(time.perf_counter() - t0)
            for t, new in zip(toks, out.tokens):
                t.append(int(new))
    same = state[False][1] == state[True][1]
    warm = steps // 4  # compile and the layout tuner's exploration
    med = {f: 1e3 * float(np.median(times[f][warm:])) for f in times}
    results[B] = dict(jax_ms=med[False], kernel_ms=med[True], ratio=med[True] / med[False], tokens_equal=same)
    print(B, results[B], flush=True)
    for r in runners.values():
        for i in range(B):
            r.allocator.free((B, i))
print(json.dumps(results))
