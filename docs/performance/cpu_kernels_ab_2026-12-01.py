"""A/B in one process (docs/performance.md section 29): TargetRunner steps of the real SmolLM2 with
both CPU kernels (the defaults) and with XLA's attention and dots (cpu_attention=False,
cpu_matmul=False), interleaved; medians of wall ms; greedy results compared.

    python docs/performance/cpu_kernels_ab_2026-12-01.py [--off matmul|attention] CONTEXT REPEATS B:K [B:K ...]
(K = 1: decode; `--off matmul`: the baseline turns off the matmul kernel only.) Prints one JSON
line per case; with both kernels off it writes docs/performance/cpu_kernels_ab_2026-12-01.json."""
import json, sys, time
from pathlib import Path
import numpy as np
from jax_backend.batch import SeqInput
from jax_backend.runner import TargetRunner

MODEL = "cache/models/SmolLM2-135M-Instruct"
args = sys.argv[1:]
off = ("matmul", "attention")
if args[0] == "--off":
    off, args = (args[1],), args[2:]
ctx, reps = int(args[0]), int(args[1])
cases = [tuple(int(x) for x in c.split(":")) for c in args[2:]]
max_b = max(b for b, _ in cases)
rng = np.random.default_rng(0)
prompts = [rng.integers(100, 40000, ctx).tolist() for _ in range(max_b)]
runners = {}
for name, flags in (("xla", {f"cpu_{kernel}": False for kernel in off}), ("kernels", {})):
    r = TargetRunner(MODEL, max_total_tokens=max_b * (ctx + 64), max_num_seqs=max_b, max_model_len=ctx + 32,
                     aux_layer_ids=(1, 8, 14, 20, 27), **flags)
    tables = [r.allocator.allocate(i, ctx + 32) for i in range(max_b)]
    for i in range(0, max_b, 4):
        r.forward([SeqInput(prompts[j], 0, tables[j]) for j in range(i, min(i + 4, max_b))])
    runners[name] = (r, tables)
results = []
for b, k in cases:
    tokens = rng.integers(100, 40000, (b, k))
    times, outs = {n: [] for n in runners}, {}
    for i in range(reps):
        for name in (list(runners) if i % 2 else list(runners)[::-1]):
            r, tables = runners[name]
            t0 = time.perf_counter()
            if k == 1:
                out = r.sample([SeqInput([int(t[0])], ctx, tables[j]) for j, t in enumerate(tokens)], [0.0] * b, [1.0] * b, [0] * b)
                outs[name] = out.tokens.tolist()
            else:
                out = r.verify([SeqInput(t.tolist(), ctx, tables[j], "all") for j, t in enumerate(tokens)])
                outs[name] = (out.accepted.tolist(), out.bonus.tolist())
            times[name].append(time.perf_counter() - t0)
    warm = reps // 3
    med = {n: 1e3 * float(np.median(ts[warm:])) for n, ts in times.items()}
    row = dict(batch=b, k=k, xla_ms=med["xla"], kernels_ms=med["kernels"], ratio=med["kernels"] / med["xla"],
               same=outs["xla"] == outs["kernels"])
    results.append(row)
    print(json.dumps(row), flush=True)
if len(off) == 2:
    Path(__file__).with_suffix(".json").write_text(json.dumps(dict(context=ctx, repeats=reps, rows=results), indent=1))
