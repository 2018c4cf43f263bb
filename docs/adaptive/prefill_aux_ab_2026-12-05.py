"""A prefill forward of the real target: the runner's forward with the drafter's aux layers and their
features copied to the host, vs NONE's program; 12 interleaved rounds, median ms (docs/adaptive.md
2026-12-05, afternoon).  python docs/adaptive/prefill_aux_ab_2026-12-05.py
"""
import functools, json, time
import numpy as np, jax
from jax_backend import SeqInput, TargetRunner, model
AUX = (1, 8, 14, 20, 27)
runner = TargetRunner("cache/models/SmolLM2-135M-Instruct", max_total_tokens=16384, max_num_seqs=64, aux_layer_ids=AUX)
bare = runner._jit_step(lambda p, kv, b: model.forward(p, runner.config, kv, b, ()))
rng = np.random.default_rng(0)
for S, L in ((1, 120), (8, 120), (32, 100)):
    tables = [runner.allocator.allocate((S, i), L) for i in range(S)]
    seqs = [SeqInput(rng.integers(1000, size=L).tolist(), 0, t) for t in tables]
    def with_aux():
        out = runner.forward(seqs); return out
    def without():
        batch, layout = runner._batch(seqs, fine_tokens=True)
        logits, aux, runner.kv_pool = bare(runner._step_params, runner.kv_pool, batch)
        return np.asarray(logits)
    fns = {"aux": with_aux, "none": without}
    for f in fns.values(): f(); f()
    res = {n: [] for n in fns}
    for r in range(12):
        for n in (("aux", "none") if r % 2 else ("none", "aux")):
            t = time.perf_counter(); fns[n](); res[n].append(time.perf_counter() - t)
    med = {n: float(np.median(v)) * 1e3 for n, v in res.items()}
    print(json.dumps(dict(seqs=S, tokens=S * L, **{k: round(v, 1) for k, v in med.items()}, ratio=round(med["aux"] / med["none"], 3))), flush=True)
    for i in range(S): runner.allocator.free((S, i))
