"""Model workers, one per speculative algorithm, registered like an outside plugin would.

Each worker runs the model for a batch of requests chosen by the scheduler:
`prefill(reqs, append)` and `decode(reqs, append)` (see `base.ModelWorker`).
"""

from sgl_dflash.spec_algorithm import SpeculativeAlgorithm


@SpeculativeAlgorithm.register("NONE")
def _autoregressive_worker(server_args):
    from sgl_dflash.workers.ar_worker import ARWorker

    return ARWorker


def _validate_dflash_args(server_args) -> None:
    from sgl_dflash.workers.dflash_worker import validate_dflash_server_args

    validate_dflash_server_args(server_args)


@SpeculativeAlgorithm.register("DFLASH", validate_server_args=_validate_dflash_args)
def _dflash_worker(server_args):
    from sgl_dflash.workers.dflash_worker import DFlashWorker

    return DFlashWorker
