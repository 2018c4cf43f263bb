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
import json, os, sys
sys.path.insert(0, os.environ["HERE"] + "/docs/performance")
from jax_backend import cpu_kernels
assert cpu_kernels.available()
from runner_steps import prefilled_runner, time_cases
ctx = int(os.environ.get("CTX", 115)); cases = [tuple(map(int, c.split("x"))) for c in os.environ["CASES"].split()]
r, tables, rng = prefilled_runner(os.environ["MODEL"], max(b for b, _ in cases), ctx)
print(json.dumps(time_cases(r, tables, rng, cases, ctx)))
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
