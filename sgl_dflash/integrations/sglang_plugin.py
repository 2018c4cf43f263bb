"""SGLang's general plugin for this package: the hooks that let SGLang's own server drive our JAX
target, installed only when our platform (sglang_platform.py) is SGLang's active one.

Declared in pyproject.toml as the `sglang.srt.plugins` entry point `dflash_jax` -> `register()`.
SGLang's `load_plugins()` calls it in every one of its processes (the launcher, the scheduler,
the detokenizer) and then applies the registered hooks (`HookRegistry.apply_hooks`). Without
SGLang installed, or on a machine where another platform is active, it does nothing.

Hooks (sglang 0.5.23 `plugins/hook_registry.py`):
- REPLACE `sglang.srt.managers.tp_worker.TpModelWorker` by `JaxTpModelWorker` (a subclass): there
  is no platform hook for the target worker; the scheduler builds it with
  `from sglang.srt.managers.tp_worker import TpModelWorker` inside `init_tp_model_worker`, so
  the replaced module attribute is what it gets (HookRegistry also re-binds modules that had
  imported the original name).
- AROUND `sglang.srt.managers.utils.validate_input_length`: SGLang's scheduler runs it on every
  generate request and aborts the request with its message (HTTP 400); we add the request
  features our workers cannot serve (logprobs, penalties, ...; sglang_args.unsupported_request).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

TP_WORKER = "sglang.srt.managers.tp_worker.TpModelWorker"
VALIDATE_REQUEST = "sglang.srt.managers.utils.validate_input_length"


def register() -> bool:
    """Register our hooks with SGLang; True when our platform is active (hooks registered)."""
    if not platform_is_active():
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_dflash.integrations.sglang_target import JaxTpModelWorker

    HookRegistry.register(TP_WORKER, JaxTpModelWorker, HookType.REPLACE)
    HookRegistry.register(VALIDATE_REQUEST, refuse_unsupported_requests, HookType.AROUND)
    logger.info("dflash_jax: SGLang's TpModelWorker runs our JAX target")
    return True


def platform_is_active() -> bool:
    try:
        from sglang.srt.platforms import current_platform
    except Exception as e:  # not installed, or an install whose import fails (missing deps)
        logger.debug("sglang is not importable (%s: %s)", type(e).__name__, e)
        return False
    from sgl_dflash.integrations.sglang_platform import DFlashJaxPlatform

    return isinstance(current_platform, DFlashJaxPlatform)


def refuse_unsupported_requests(original, req, *args, **kwargs):
    """AROUND hook: SGLang's length check, preceded by ours (a message aborts the request)."""
    from sgl_dflash.integrations.sglang_args import unsupported_request

    return unsupported_request(req) or original(req, *args, **kwargs)
