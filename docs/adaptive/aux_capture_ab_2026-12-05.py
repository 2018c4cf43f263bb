"""A decode sampling step of the real target with the drafter's 5 aux layers captured vs none (NONE's
program), in the scan and the switch layer loops, 1 / 8 / 32 sequences at context 200, interleaved
(45 rounds, order rotating), median ms (docs/adaptive.md 2026-12-05, afternoon).

    python docs/adaptive/aux_capture_ab_2026-12-05.py scan|switch
"""
import functools, json, sys, time
import numpy as np, jax
from jax_backend import SeqInput, TargetRunner
from jax_backend import steps
from jax_backend.runner import sampling

AUX = (1, 8, 14, 20, 27)
loop = sys.argv[1]
runner = TargetRunner("cache/models/SmolLM2-135M-Instruct", max_total_tokens=16384, max_num_seqs=64,
                      aux_layer_ids=AUX, layer_loop=loop)
fns = {a: runner._jit_step(functools.partial(steps.sample_step, config=runner.config, aux_layer_ids=aux, mode="greedy"))
       for a, aux in (("aux", AUX), ("none", ()))}
rng = np.random.default_rng(0)
for B in (1, 8, 32):
    ctx = 200
    tables = [runner.allocator.allocate(f"s{B}_{i}", ctx + 200) for i in range(B)]
    pos = ctx
    def step(name):
        global pos
        seqs = [SeqInput([int(rng.integers(1000))], pos, t) for t in tables]
        batch, layout = runner._batch(seqs)
        rows = batch.logits_indices.shape[0]
        arrays = sampling.per_row_params(rows, 1, [0.0]*B, [1.0]*B, [-1]*B)
        t0 = time.perf_counter()
        out = runner._run(fns[name], "sample", batch, "greedy", False, *arrays, None)
        runner.kv_pool = out[-1]; jax.block_until_ready(out[0]); np.asarray(out[0])
        pos += 1
        return time.perf_counter() - t0
    for name in fns: step(name); step(name)
    res = {n: [] for n in fns}
    for r in range(45):
        for name in (("aux", "none") if r % 2 else ("none", "aux")):
            res[name].append(step(name))
    med = {n: float(np.median(v)) * 1e3 for n, v in res.items()}
    print(json.dumps(dict(loop=loop, B=B, **{k: round(v, 2) for k, v in med.items()},
                          aux_over_none=round(med["aux"] / med["none"], 3))), flush=True)
    for i in range(B): runner.allocator.free(f"s{B}_{i}")
