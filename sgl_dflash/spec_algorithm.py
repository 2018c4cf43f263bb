"""Speculative-algorithm registry, shaped like SGLang's `SpeculativeAlgorithm`.

An algorithm is a name plus a worker factory `factory(server_args) -> WorkerClass`; the scheduler
builds `WorkerClass(server_args)`. Built-in algorithms register through the same public decorator
an outside plugin uses:

    @SpeculativeAlgorithm.register("MY_ALGO", validate_server_args=check_my_args)
    def my_algo_factory(server_args):
        return MyWorker
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

WorkerFactory = Callable[[Any], type]
ServerArgsValidator = Callable[[Any], None]


class UnknownSpeculativeAlgorithmError(ValueError):
    pass


class _RegistryMeta(type):
    def __iter__(cls) -> Iterator["SpeculativeAlgorithm"]:
        return iter(list(cls._by_name.values()))

    def __getattr__(cls, name: str) -> "SpeculativeAlgorithm":
        # SpeculativeAlgorithm.DFLASH etc. for every registered name.
        registry = cls.__dict__.get("_by_name", {})
        if name in registry:
            return registry[name]
        raise AttributeError(name)


class SpeculativeAlgorithm(metaclass=_RegistryMeta):
    """A registered speculative algorithm (NONE = plain autoregressive decoding)."""

    _by_name: dict[str, "SpeculativeAlgorithm"] = {}
    _lock = threading.Lock()

    def __init__(
        self,
        name: str,
        factory: WorkerFactory,
        supports_overlap: bool,
        validate_server_args: ServerArgsValidator | None,
    ):
        self.name = name
        self.factory = factory
        self.supports_overlap = supports_overlap
        self.validate_server_args = validate_server_args

    def __repr__(self) -> str:
        return f"SpeculativeAlgorithm.{self.name}"

    def __str__(self) -> str:
        return self.name

    def is_none(self) -> bool:
        return self.name == "NONE"

    def is_dflash(self) -> bool:
        return self.name == "DFLASH"

    def worker_class(self, server_args: Any) -> type:
        return self.factory(server_args)

    def create_worker(self, server_args: Any) -> Any:
        return self.worker_class(server_args)(server_args)

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
            with cls._lock:
                if key in cls._by_name:
                    raise ValueError(f"speculative algorithm {key!r} is already registered")
                cls._by_name[key] = cls(key, factory, supports_overlap, validate_server_args)
            return factory

        return decorator

    @classmethod
    def unregister(cls, name: str) -> None:
        with cls._lock:
            cls._by_name.pop(name.strip().upper(), None)

    @classmethod
    def from_string(cls, name: str | None) -> "SpeculativeAlgorithm":
        """`None` and "NONE" mean no speculation; other names are looked up case-insensitively."""
        _ensure_builtins_registered()
        key = "NONE" if name is None else str(name).strip().upper()
        try:
            return cls._by_name[key]
        except KeyError:
            raise UnknownSpeculativeAlgorithmError(
                f"unknown speculative algorithm {name!r}; registered: {cls.names()}"
            ) from None

    @classmethod
    def names(cls) -> list[str]:
        return list(cls._by_name)


def _ensure_builtins_registered() -> None:
    # The built-in workers register themselves on import (through `register`, like a plugin).
    import sgl_dflash.workers  # noqa: F401
