"""Process-wide count of JAX compilations and their seconds, from JAX's own monitoring events.

Every compile starts with a trace of the function at the new shapes (also one that the persistent
compilation cache then serves), so counting traces counts compiles: whatever compiled them (a
jitted step, a helper, an eager op at a new shape). Benchmarks use it to leave compiles out of
their timings. Not the adaptive worker: a jitted function can grow its cache without a new trace
(new argument kinds), and its own count of cache entries is what its cost model was tuned with
(docs/adaptive.md, 2026-11-29 afternoon).
"""

from __future__ import annotations

import jax


class CompileCounter:
    count = 0  # compilations (traces) since `install`
    seconds = 0.0  # tracing, lowering and backend compile, as JAX reports them
    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            jax.monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            cls.count += 1
        if event.startswith("/jax/core/compile/"):
            cls.seconds += duration
