"""A/B of the startup sweep's readings (`CostModel.startup_reading`) in one process:
`bench_batches`' calls (fresh engines with the defaults, batches of unseen prompts, engines
stepping in turn) with NONE, the adaptive engine as shipped, and a second adaptive engine whose
startup readings are dropped after its sweep (loads it has not served priced by the line through
the shapes it has, as before 2026-12-04).

    python docs/adaptive/startup_readings_ab_2026-12-04.py --out OUT [other bench_batches flags]
"""
import sys

from sgl_dflash.tools import bench_batches, bench_engines


def make_engines(args) -> dict:
    engines = bench_engines.make_engines(args)
    unread = bench_engines.adaptive_engine(args)
    cost = unread.scheduler.worker.policy.cost
    assert cost.startup, "the sweep took no readings"
    cost.startup.clear()
    cost._memo.clear()
    engines["unread"] = unread
    return engines


bench_batches.make_engines = make_engines
bench_batches.main(sys.argv[1:])
