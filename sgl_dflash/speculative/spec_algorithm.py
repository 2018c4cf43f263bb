"""Speculative-algorithm registry: an enum of the built-in algorithms plus a table of worker
factories, shaped like SGLang's `SpeculativeAlgorithm` (`sglang.srt.speculative.spec_info`).

A worker factory is `factory(server_args) -> WorkerClass`; the scheduler builds
`WorkerClass(server_args)`. Built-ins are rows of the tables below. A plugin registers its own
algorithm through the same decorator SGLang offers; `from_string` returns either an enum member
or the plugin's `CustomSpecAlgo`, which answer the same questions:

    @SpeculativeAlgorithm.register("MY_ALGO", validate_server_args=check_my_args)
    def my_algo_factory(server_args):
        return MyWorker

Factories import their worker when called, so reading server arguments stays light (no JAX or
torch import) and nothing here imports back into the modules that use the registry.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Callable

from sgl_dflash.errors import ServerArgsError

WorkerFactory = Callable[[Any], type]
ServerArgsValidator = Callable[[Any], None]


class SpeculativeAlgorithm(enum.Enum):
    """The built-in algorithms (NONE = plain autoregressive decoding)."""

    NONE = "NONE"
    DFLASH = "DFLASH"

    def is_none(self) -> bool:
        return self is SpeculativeAlgorithm.NONE

    def is_dflash(self) -> bool:
        return self is SpeculativeAlgorithm.DFLASH

    @property
    def supports_overlap(self) -> bool:
        return False  # every worker here runs synchronously

    @property
    def validate_server_args(self) -> ServerArgsValidator | None:
        return _VALIDATORS.get(self)

    def worker_class(self, server_args: Any) -> type:
        return _WORKER_FACTORIES[self](server_args)

    def create_worker(self, server_args: Any) -> Any:
        return self.worker_class(server_args)(server_args)

    # -- lookup and plugins ---------------------------------------------------------------
    @classmethod
    def from_string(cls, name: str | None) -> "SpeculativeAlgorithm | CustomSpecAlgo":
        """`None` and "NONE" mean no speculation; other names are looked up case-insensitively."""
        key = "NONE" if name is None else str(name).strip().upper()
        if key in cls.__members__:
            return cls[key]
        if key in _CUSTOM:
            return _CUSTOM[key]
        raise ServerArgsError(
            f"--speculative-algorithm: unknown speculative algorithm {name!r}; registered: {cls.names()}"
        )

    @classmethod
    def names(cls) -> list[str]:
        return list(cls.__members__) + list(_CUSTOM)

    @classmethod
    def register(
        cls,
        name: str,
        *,
        supports_overlap: bool = False,
        validate_server_args: ServerArgsValidator | None = None,
    ) -> Callable[[WorkerFactory], WorkerFactory]:
        """Decorator registering `factory(server_args) -> WorkerClass` under `name` (case-insensitive)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"speculative algorithm name must be a non-empty string, got {name!r}")
        key = name.strip().upper()

        def decorator(factory: WorkerFactory) -> WorkerFactory:
            if not callable(factory):
                raise TypeError(f"worker factory for {key} must be callable, got {factory!r}")
            with _LOCK:
                if key in cls.__members__ or key in _CUSTOM:
                    raise ValueError(f"speculative algorithm {key!r} is already registered")
                _CUSTOM[key] = CustomSpecAlgo(key, factory, supports_overlap, validate_server_args)
            return factory

        return decorator

    @classmethod
    def unregister(cls, name: str) -> None:
        with _LOCK:
            _CUSTOM.pop(name.strip().upper(), None)


class CustomSpecAlgo:
    """A plugin's algorithm; answers like a `SpeculativeAlgorithm` member."""

    def __init__(self, name: str, factory: WorkerFactory, supports_overlap: bool,
                 validate_server_args: ServerArgsValidator | None):
        self.name = name
        self.factory = factory
        self.supports_overlap = supports_overlap
        self.validate_server_args = validate_server_args

    def __repr__(self) -> str:
        return f"CustomSpecAlgo({self.name!r})"

    def is_none(self) -> bool:
        return False

    def is_dflash(self) -> bool:
        return False

    def worker_class(self, server_args: Any) -> type:
        return self.factory(server_args)

    def create_worker(self, server_args: Any) -> Any:
        return self.worker_class(server_args)(server_args)


# -- the built-in rows ------------------------------------------------------------------------
def _target_worker(server_args: Any) -> type:
    from sgl_dflash.model_executor.target_worker import TargetWorker

    return TargetWorker


def _dflash_worker(server_args: Any) -> type:
    if getattr(server_args, "speculative_adaptive", False):
        from sgl_dflash.speculative.adaptive_worker import AdaptiveDFlashWorker

        return AdaptiveDFlashWorker
    from sgl_dflash.speculative.dflash_worker import DFlashWorker

    return DFlashWorker


def _validate_dflash(server_args: Any) -> None:
    from sgl_dflash.speculative.dflash_worker import validate_dflash_server_args

    validate_dflash_server_args(server_args)


_WORKER_FACTORIES: dict[SpeculativeAlgorithm, WorkerFactory] = {
    SpeculativeAlgorithm.NONE: _target_worker,
    SpeculativeAlgorithm.DFLASH: _dflash_worker,
}
_VALIDATORS: dict[SpeculativeAlgorithm, ServerArgsValidator] = {
    SpeculativeAlgorithm.DFLASH: _validate_dflash,
}
_CUSTOM: dict[str, CustomSpecAlgo] = {}  # plugins, by upper-case name
_LOCK = threading.Lock()
