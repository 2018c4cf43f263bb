"""A/B of the target's prefill step (docs/performance.md section 36): no aux layers vs the drafter's
five aux layers gathered through the layer scan's carry, one process, 32 random prompts of 80-140
tokens, 6 rounds in alternating order. (The third variant of the section, the aux rows as the
scan's ys, was a throwaway edit of model.forward: `scanned_ys` returned (h, (kv, h)) and the aux
rows were gathered from the [L, T, H] stack after the loop.)

    python docs/performance/aux_carry_ab_2026-12-04.py OUT.json
"""
import sys, time, json
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import numpy as np, jax
from jax_backend.runner import TargetRunner
from jax_backend.batch import SeqInput
path = ROOT / "cache/models/SmolLM2-135M-Instruct"
AUX = [1, 8, 14, 20, 27]
rng = np.random.default_rng(0)
lens = [int(rng.integers(80, 140)) for _ in range(32)]
prompts = [rng.integers(0, 40000, n).tolist() for n in lens]
runners = {}
for name, aux in (("none", []), ("carry", AUX)):
    r = TargetRunner(path, max_num_seqs=48, max_model_len=8200, max_total_tokens=16384, aux_layer_ids=aux)
    tables = [r.allocator.allocate(i, n + 1) for i, n in enumerate(lens)]
    seqs = [SeqInput(p, 0, t, "last") for p, t in zip(prompts, tables)]
    t = time.perf_counter(); out = r.forward(seqs); print(name, "compile+run", time.perf_counter() - t, flush=True)
    runners[name] = (r, seqs, out)
times = {k: [] for k in runners}
step_times = {k: [] for k in runners}
for rep in range(6):
    order = list(runners) if rep % 2 == 0 else list(runners)[::-1]
    for k in order:
        r, seqs, _ = runners[k]
        t = time.perf_counter(); r.forward(seqs); times[k].append(time.perf_counter() - t)
    for k in order:
        r, seqs, _ = runners[k]
        batch, layout = r._batch(seqs, fine_tokens=True)
        t = time.perf_counter()
        logits, aux, r.kv_pool = r._step(r._step_params, r.kv_pool, batch)
        jax.block_until_ready((logits, aux)); step_times[k].append(time.perf_counter() - t)
res = {k: {"forward_median_s": float(np.median(times[k])), "step_median_s": float(np.median(step_times[k])),
           "forward_s": times[k], "step_s": step_times[k]} for k in runners}
res["tokens"] = sum(lens)
print(json.dumps({k: (v if k == "tokens" else {a: b for a, b in v.items() if "median" in a}) for k, v in res.items()}, indent=1))
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "aux_carry_ab.json", "w"), indent=1)
