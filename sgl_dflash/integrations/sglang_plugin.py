"""SGLang plugin: registers the `DFLASH_JAX` speculative algorithm with SGLang.

Declared in pyproject.toml as the `sglang.srt.plugins` entry point `dflash_jax`; SGLang calls
`register()` (zero arguments) in each of its processes (`sglang.srt.plugins.load_plugins`,
allow-list env `SGLANG_PLUGINS`). Without SGLang installed, `register()` does nothing.

What SGLang gets:
- `--speculative-algorithm DFLASH_JAX` becomes a known name (`SpeculativeAlgorithm.from_string`),
  a `CustomSpecAlgo` through SGLang's public `SpeculativeAlgorithm.register` decorator.
- `validate_server_args`: run by SGLang's argument resolution at startup. It refuses a missing or
  unreadable draft model, a drafter that does not fit the target (hidden size, vocabulary,
  target layer ids: the checks of `torchax_proposer.loader.read_draft_config`) and a block size
  beyond the drafter's, and it defaults `speculative_num_draft_tokens` to the drafter's
  block size and turns overlap scheduling off (this algorithm is synchronous).
- the worker factory returns `DFlashJaxWorker`. The JAX runtime owns its own target, paged KV
  cache and scheduler, while SGLang's scheduler drives torch model runners through its
  `TpModelWorker`; the two cannot share one process's batches. The worker therefore stops the
  SGLang scheduler at construction with a message pointing at this package's SGLang-compatible
  server (`python -m sgl_dflash.launch_server`, same flags and HTTP API).
"""

from __future__ import annotations

import logging
from typing import Any

from sgl_dflash.errors import ServerArgsError

logger = logging.getLogger(__name__)

ALGORITHM_NAME = "DFLASH_JAX"


def register() -> bool:
    """Register DFLASH_JAX with SGLang; True when it is registered (now or before).

    Safe to call any number of times, and a no-op returning False when SGLang is not importable.
    """
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    except Exception as e:  # not installed, or an install whose import fails (missing deps)
        logger.debug("sglang is not importable (%s: %s); DFLASH_JAX not registered", type(e).__name__, e)
        return False
    try:
        existing = SpeculativeAlgorithm.from_string(ALGORITHM_NAME)
    except ValueError:
        existing = None
    if existing is not None:
        return getattr(existing, "factory", None) is worker_factory
    SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        supports_overlap=False,
        validate_server_args=validate_server_args,
    )(worker_factory)
    logger.info("registered speculative algorithm %s with SGLang", ALGORITHM_NAME)
    return True


def validate_server_args(server_args: Any) -> None:
    """SGLang's startup hook: refuse arguments DFLASH_JAX cannot serve; fill its defaults.
    The checks are DFLASH's own (`validate_dflash_server_args`); errors are `ServerArgsError`."""
    from sgl_dflash.speculative.dflash_worker import validate_dflash_server_args

    validate_dflash_server_args(server_args, algorithm=ALGORITHM_NAME)
    # Registered with supports_overlap=False: SGLang refuses to build the worker otherwise.
    server_args.disable_overlap_schedule = True


def worker_factory(server_args: Any) -> type:
    """`factory(server_args) -> WorkerClass`, as SGLang's registry expects."""
    return DFlashJaxWorker


class DFlashJaxWorker:
    """What SGLang's scheduler instantiates as the speculative worker for DFLASH_JAX."""

    def __init__(self, server_args: Any = None, gpu_id: int = 0, nccl_port: int = 0,
                 target_worker: Any = None, **kwargs: Any):
        draft = getattr(server_args, "speculative_draft_model_path", None)
        raise ServerArgsError(
            f"{ALGORITHM_NAME} runs its target and drafter in JAX with its own scheduler and KV "
            "cache, which SGLang's torch model runners cannot drive. Serve it with the "
            "SGLang-compatible server of this package (same flags, same HTTP API): "
            f"python -m sgl_dflash.launch_server --model-path {getattr(server_args, 'model_path', 'MODEL')} "
            f"--speculative-algorithm DFLASH --speculative-draft-model-path {draft or 'DRAFT'}"
        )
