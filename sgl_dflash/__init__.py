"""sgl-dflash runtime: scheduler, DFLASH worker, Engine, server, SGLang plugin.

    import sgl_dflash
    engine = sgl_dflash.Engine(model_path=..., speculative_algorithm="DFLASH",
                               speculative_draft_model_path=...)
    engine.generate("Hello", {"temperature": 0, "max_new_tokens": 32})
"""

from importlib import import_module
from typing import Any

# Public names, imported on first use so that `import sgl_dflash.<submodule>` stays light.
_EXPORTS = {
    "Engine": "sgl_dflash.entrypoints.engine",
    "ServerArgs": "sgl_dflash.server_args",
    "SamplingParams": "sgl_dflash.sampling_params",
    "Scheduler": "sgl_dflash.managers.scheduler",
    "Req": "sgl_dflash.managers.schedule_batch",
    "SpeculativeAlgorithm": "sgl_dflash.speculative.spec_algorithm",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sgl_dflash' has no attribute {name!r}")
