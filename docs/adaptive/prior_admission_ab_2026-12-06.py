"""A/B of the admission's prior (the drafter's held-out acceptance) and its pricing at the joining
requests' context, in one process: bench_batches with NONE, the adaptive engine of this commit and
a second adaptive engine as before (no prior; admission priced at the last step's context).
Two adaptive engines in one process need vm.max_map_count raised (262144 here; jax_backend.compiled_memory).
    python docs/adaptive/prior_admission_ab_2026-12-06.py --datasets mixed gsm8k mt-bench --batch-sizes 1 8 32 --repeats 2 --out OUT"""
import sys

from sgl_dflash.tools import bench_batches, bench_engines


def make_engines(args) -> dict:
    engines = bench_engines.make_engines(args)
    before = bench_engines.adaptive_engine(args)
    worker = before.scheduler.worker
    assert worker.policy.prior_acceptance is not None and engines["adaptive"].scheduler.worker.policy.prior_acceptance is not None
    worker.policy.prior_acceptance = None
    cost, extend = worker.policy.cost, worker.forward_extend

    def forward_extend(batch):  # admission priced wherever the last step left the cost model
        cost.at = lambda *args: None
        try:
            return extend(batch)
        finally:
            del cost.at

    worker.forward_extend = forward_extend
    engines["before"] = before
    return engines


bench_batches.make_engines = make_engines
bench_batches.main(sys.argv[1:])
