"""The real target's steps with and without GGUF blocks (TargetRunner gguf_blocks=True / False), one
process, interleaved, median of 15; outputs compared. argv[1]: context (256)."""
import os, sys, time, numpy as np
from jax_backend import SeqInput, TargetRunner
from runner_steps import step_fns  # (this folder)
M = "cache/models/SmolLM2-135M-Instruct"
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 256
runners = {}
for name, gb in (("f32", False), ("blocks", True)):
    t0 = time.time()
    r = TargetRunner(M, page_size=16, max_total_tokens=32 * (ctx + 32) + 64, max_num_seqs=32, max_model_len=ctx + 32, layer_loop=os.environ.get("LAYER_LOOP", "scan"), gguf_blocks=gb, aux_layer_ids=(1, 10, 18, 27))
    print(name, "load", round(time.time() - t0, 1), "s, blocks:", sorted(r.params.get("blocks", {})))
    rng = np.random.default_rng(0)
    tables = [r.allocator.allocate(i, ctx + 32) for i in range(32)]
    for g in range(0, 32, 4):
        r.forward([SeqInput(rng.integers(0, r.config.vocab_size, ctx).tolist(), 0, tables[j]) for j in range(g, g + 4)])
    runners[name] = (r, tables)
rng = np.random.default_rng(1)
for batch, k in [tuple(map(int, c.split("x"))) for c in os.environ.get("CASES", "1x1 4x1 1x8 1x16 4x4 32x1").split()]:
    tokens = rng.integers(0, 49152, (batch, k))
    fns, outs = step_fns(runners, tokens, ctx)
    a, b = outs["f32"], outs["blocks"]
    fields = ("tokens",) if k == 1 else ("accepted", "bonus", "features")
    same = all(np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))) for f in fields)
    for _ in range(3):
        for f in fns.values(): f()
    ts = {n: [] for n in fns}
    for _ in range(15):
        for n, f in fns.items():
            t0 = time.perf_counter(); f(); ts[n].append(time.perf_counter() - t0)
    m = {n: np.median(v) * 1e3 for n, v in ts.items()}
    print(f"B={batch} K={k}: f32 {m['f32']:.2f} ms  blocks {m['blocks']:.2f} ms  ratio {m['blocks']/m['f32']:.3f}  outputs equal: {same}", flush=True)
