"""A/B of the realized gains (`speculative/realized.py`) in one process: `bench_batches`' calls
(fresh engines with the defaults, batches of unseen prompts, engines stepping in turn), with
NONE, the adaptive engine as shipped and a second adaptive engine whose realized gains are never
read often enough to decide (admission by the prediction alone, no context lost), as the policy
ran before them. (The first two runs of 2026-12-03 ran an earlier version, docs/adaptive.md.)

    python docs/adaptive/guard_ab_2026-12-03.py --out OUT [other bench_batches flags]
"""
import sys

from sgl_dflash.speculative.realized import RealizedGains
from sgl_dflash.tools import bench_batches, bench_engines


def make_engines(args) -> dict:
    engines = bench_engines.make_engines(args)
    unguarded = bench_engines.adaptive_engine(args)
    unguarded.scheduler.worker.policy.realized = RealizedGains(min_gain_rows=1 << 30)
    engines["unguarded"] = unguarded
    return engines


bench_batches.make_engines = make_engines
bench_batches.main(sys.argv[1:])
