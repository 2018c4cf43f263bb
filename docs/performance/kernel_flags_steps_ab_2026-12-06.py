"""The real target's decode / verify steps with the CPU kernels built two (or more) ways: one
runner per process, builds alternating by round (`kernel_builds.run_builds`), median of 12 steps
after 8; cases BxK, env CTX (115), ROUNDS (3); outputs asserted equal across builds. Variants are
"name:compiler flags" (SGL_DFLASH_KERNEL_FLAGS). `PYTHONPATH=. python
docs/performance/kernel_flags_steps_ab_2026-12-06.py "before:-DBLOCKS_SCRATCH_ROWS=1000000" "after:" 32x1 8x4 4x8`
(docs/performance.md section 50)."""
import json, os, statistics, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import run_builds  # (this folder)
CODE = r'''
import json, os, sys, time, numpy as np
sys.path.insert(0, os.environ["HERE"] + "/docs/performance")
from jax_backend import SeqInput, TargetRunner, cpu_kernels
from runner_steps import step_fns
assert cpu_kernels.available()
ctx = int(os.environ.get("CTX", 115)); cases = [tuple(map(int, c.split("x"))) for c in os.environ["CASES"].split()]
B = max(b for b, _ in cases)
r = TargetRunner(os.environ["MODEL"], page_size=16, max_total_tokens=B * (ctx + 64), max_num_seqs=B, max_model_len=ctx + 32, aux_layer_ids=(1, 8, 14, 20, 27))
rng = np.random.default_rng(0)
tables = [r.allocator.allocate(i, ctx + 32) for i in range(B)]
for g in range(0, B, 4):
    r.forward([SeqInput(rng.integers(0, 49152, ctx).tolist(), 0, tables[j]) for j in range(g, min(B, g + 4))])
res = {}
for b, k in cases:
    fns, _ = step_fns({"r": (r, tables)}, rng.integers(0, 49152, (b, k)), ctx)
    for _ in range(8): o = fns["r"]()
    ts = []
    for _ in range(12):
        t0 = time.perf_counter(); fns["r"](); ts.append(time.perf_counter() - t0)
    out = np.asarray(o.tokens).tolist() if k == 1 else [np.asarray(o.accepted).tolist(), np.asarray(o.bonus).tolist()]
    res[f"{b}x{k}"] = {"ms": float(np.median(ts) * 1e3), "out": out}
print(json.dumps(res))
'''
variants = [a for a in sys.argv[1:] if ":" in a]
cases = [a for a in sys.argv[1:] if ":" not in a]
here = str(Path(__file__).resolve().parents[2])
os.environ.update(HERE=here, CASES=" ".join(cases), MODEL=os.environ.get("MODEL", here + "/cache/models/SmolLM2-135M-Instruct"))
runs = run_builds(CODE, variants, int(os.environ.get("ROUNDS", 3)))
names = list(runs)
for case in cases:
    outs = {json.dumps(r[case]["out"]) for n in names for r in runs[n]}
    assert len(outs) == 1, f"{case}: outputs differ between builds"
    ms = {n: [round(r[case]["ms"], 2) for r in runs[n]] for n in names}
    med = {n: statistics.median(v) for n, v in ms.items()}
    print(case, ms, "ratio to", names[0], {n: round(med[n] / med[names[0]], 3) for n in names[1:]}, flush=True)
