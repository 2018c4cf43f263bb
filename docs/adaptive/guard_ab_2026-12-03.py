"""A/B of the realized gains (`speculative/realized.py`) in one process: `bench_batches`' calls
(fresh engines with the defaults, batches of unseen prompts, engines stepping in turn), with
NONE, the adaptive engine as shipped and a second adaptive engine whose realized gains are never
read often enough to decide (admission by the prediction alone, no context lost), as the policy
ran before them. (The first two runs of 2026-12-03 ran an earlier version, docs/adaptive.md.)

    python docs/adaptive/guard_ab_2026-12-03.py --out OUT [other bench_batches flags]
"""
import sys

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.speculative.realized import RealizedGains
from sgl_dflash.tools import bench_batches, bench_engines


def make_engines(args) -> dict:
    engines = bench_engines.make_engines(args)
    unguarded = Engine(model_path=args.model_path, random_seed=0, speculative_algorithm="DFLASH",
                       speculative_draft_model_path=args.draft_model_path,
                       speculative_token_map=args.speculative_token_map,
                       speculative_num_draft_tokens=args.adaptive_bound, speculative_adaptive=True)
    unguarded.scheduler.worker.policy.realized = RealizedGains(min_gain_rows=1 << 30)
    engines["unguarded"] = unguarded
    return engines


bench_batches.make_engines = make_engines
bench_batches.main(sys.argv[1:])
