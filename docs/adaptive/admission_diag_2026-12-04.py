"""What the admission rule saw (docs/adaptive.md, 2026-12-04): `bench_batches` with NONE and the
adaptive engine, printing at each load's admission (a new line per 50 cost-model steps) the
realized gain, the typical gain, the drafts read, the startup scale, predicted costs (ms) of the
plain step, of verifies of 2 and 4 rows per request and of drafts of 2, 4 and 8, and the typical
(every drafted position) and verified-only acceptance per position.

    python docs/adaptive/admission_diag_2026-12-04.py --out OUT --datasets gsm8k --repeats 1
"""
import sys, numpy as np
from sgl_dflash.speculative.cost_model import step_shape
from sgl_dflash.tools import bench_batches, bench_engines

def make_engines(args):
    engines = bench_engines.make_engines(args)
    policy = engines["adaptive"].scheduler.worker.policy
    orig = policy.drafts_may_pay
    seen = set()
    def logged(n):
        out = orig(n)
        key = (n, out, policy.cost._steps // 50)
        if key not in seen:
            seen.add(key)
            c = policy.cost
            tg = policy.typical_gain(n); ds = policy.calibrator.drafts_seen(0)
            print(f"\nADMIT n={n} -> {out} steps={c._steps} ctx_gain={policy.realized.context_gain(n)} lost={policy.context_lost(n)} "
                  f"typical_gain={tg:.3f} seen={ds} v4={c.verify(step_shape(np.full(n,4)))*1e3:.1f} d4={c.draft(n,4)*1e3:.1f} scale_n={c._startup_scale(n):.3f} scale={c._startup_scale(None):.3f} "
                  f"plain={c.verify(step_shape(np.ones(n,np.int64)))*1e3:.1f} v2={c.verify(step_shape(np.full(n,2)))*1e3:.1f} "
                  f"d2={c.draft(n,2)*1e3:.1f} d8={c.draft(n,8)*1e3:.1f} tm={np.round(policy.calibrator.typical_means(0)[:4],3)} "
                  f"pm={np.round(policy.calibrator.position_means(0)[:4],3)} served={sorted(c.verify_s)[:12]}", flush=True)
        return out
    policy.drafts_may_pay = logged
    return engines

bench_batches.make_engines = make_engines
bench_batches.main(sys.argv[1:])
