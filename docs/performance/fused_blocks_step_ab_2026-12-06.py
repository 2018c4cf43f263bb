"""The real target's steps with the q/k/v and gate/up block stacks fused (`loader.fuse_block_stacks`,
one kernel call each) against separate (the loader's fusion replaced by the identity), two runners
in one process, interleaved, median of 15 per round; outputs compared bit for bit.
env CASES (default "1x1 4x1 1x8 1x16 4x4"), ROUNDS (3); argv[1]: context (256)."""
import os, sys, time
import numpy as np
from jax_backend import SeqInput, TargetRunner, loader
from runner_steps import step_fns  # (this folder)

M = "cache/models/SmolLM2-135M-Instruct"
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 256
runners = {}
fuse = loader.fuse_block_stacks
for name, fn in (("separate", lambda stacks: stacks), ("fused", fuse)):
    loader.fuse_block_stacks = fn
    r = TargetRunner(M, page_size=16, max_total_tokens=8 * (ctx + 32) + 64, max_num_seqs=8, max_model_len=ctx + 32,
                     aux_layer_ids=(1, 8, 14, 20, 27))
    print(name, "blocks:", sorted(r.params["blocks"]), flush=True)
    rng = np.random.default_rng(0)
    tables = [r.allocator.allocate(i, ctx + 32) for i in range(4)]
    r.forward([SeqInput(rng.integers(0, r.config.vocab_size, ctx).tolist(), 0, tables[j]) for j in range(4)])
    runners[name] = (r, tables)
loader.fuse_block_stacks = fuse
rng = np.random.default_rng(1)
for batch, k in [tuple(map(int, c.split("x"))) for c in os.environ.get("CASES", "1x1 4x1 1x8 1x16 4x4").split()]:
    tokens = rng.integers(0, 49152, (batch, k))
    fns, outs = step_fns(runners, tokens, ctx)
    a, b = outs["separate"], outs["fused"]
    fields = ("tokens", "features") if k == 1 else ("accepted", "bonus", "features")
    same = all(np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))) for f in fields)
    for _ in range(5):
        for f in fns.values():
            f()
    for rnd in range(int(os.environ.get("ROUNDS", 3))):
        ts = {n: [] for n in fns}
        for i in range(15):
            for n in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                t0 = time.perf_counter(); fns[n](); ts[n].append(time.perf_counter() - t0)
        m = {n: np.median(v) * 1e3 for n, v in ts.items()}
        print(f"B={batch} K={k} round {rnd}: separate {m['separate']:.2f} ms  fused {m['fused']:.2f} ms  "
              f"ratio {m['fused'] / m['separate']:.3f}  outputs equal: {same}", flush=True)
