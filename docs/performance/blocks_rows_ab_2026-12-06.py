"""The real target's steps with `model.BLOCKS_MAX_ROWS` 16 vs 32 (kernel steps of 17-32 rows reading the float32 weights or the GGUF blocks), one runner per process, processes alternating, median of 12 steps after 8; cases BxK, env CTX (115), ROUNDS (3), BMRS (the two bounds, "16 32"); outputs asserted equal. `python docs/performance/blocks_rows_ab_2026-12-06.py 32x1 24x1 8x4 4x8` (docs/performance.md section 49)."""
import json, os, subprocess, sys
from pathlib import Path
HERE = str(Path(__file__).resolve().parents[2])
CODE = r'''
import json, os, sys
sys.path.insert(0, os.environ["HERE"] + "/docs/performance")
import jax_backend.model as M
M.BLOCKS_MAX_ROWS = int(os.environ["BMR"])  # read when a step is traced
from runner_steps import prefilled_runner, time_cases
ctx = int(os.environ.get("CTX", 115)); cases = [tuple(map(int, c.split("x"))) for c in sys.argv[1:]]
r, tables, rng = prefilled_runner(os.environ["MODEL"], max(b for b, _ in cases), ctx)
print(json.dumps(time_cases(r, tables, rng, cases, ctx)))
'''
cases = sys.argv[1:]
A, B = map(int, os.environ.get("BMRS", "16 32").split())  # the two bounds compared (section 50: 32 64)
res = {}
for rnd in range(int(os.environ.get("ROUNDS", 3))):
    for bmr in ((A, B) if rnd % 2 == 0 else (B, A)):
        out = subprocess.run([sys.executable, "-c", CODE, *cases], cwd=HERE, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": HERE, "BMR": str(bmr), "HERE": HERE, "MODEL": HERE + "/cache/models/SmolLM2-135M-Instruct"})
        line = [l for l in out.stdout.splitlines() if l.startswith("{")]
        if not line: print(out.stderr[-2000:]); sys.exit(1)
        for c, d in json.loads(line[-1]).items(): res.setdefault(c, {}).setdefault(bmr, []).append(d)
    print("round", rnd, flush=True)
for c, d in res.items():
    b, n = [x["ms"] for x in d[A]], [x["ms"] for x in d[B]]
    same = all(x["out"] == d[A][0]["out"] for x in d[A] + d[B])
    print(c, f"{A}:", [round(x, 2) for x in b], f"{B}:", [round(x, 2) for x in n], "median ratio", round(sorted(n)[len(n)//2] / sorted(b)[len(b)//2], 3), "same outputs", same)
