"""Python's garbage collector in a serving process: freeze what startup built, report long passes.

A started engine holds ~1.5 million Python objects (JAX, torch and transformers, the models'
modules, the compiled programs' wrappers), and nearly all of them live as long as the process.
Python's full collection (generation 2) walks every tracked object: 0.62 s on a 2-core CPU,
landing on whichever step happens to allocate when it is due. `freeze` moves what exists to the
permanent generation, so later full passes walk only what serving allocated since
(docs/server.md, "Garbage collection"). A server (`TokenizerManager`) freezes once its scheduler
and worker are built (the adaptive worker's startup sweep compiled); `--disable-gc-freeze` leaves
the collector as Python sets it. An in-process `Engine` does not by default: a process may build
several and drop them, and a frozen engine's reference cycles (its device buffers among them)
would outlive it; `Engine.freeze_gc()` (SGLang's `/freeze_gc` on a server) freezes on demand.
`--gc-warning-threshold-secs` (SGLang's flag) logs every pass that takes longer.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze(context: str) -> int:
    """Collects what is garbage now, then moves every object left to the permanent generation.
    Returns how many objects are frozen (all freezes of the process so far)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d Python objects frozen out of garbage collection (%.2f s)", context, frozen,
                time.perf_counter() - start)
    return frozen


_watched: list[float] = []  # the threshold of the installed callback (one per process)


def warn_on_long_passes(threshold_secs: float) -> None:
    """Logs a warning for every collection longer than `threshold_secs` (0: none). One callback
    per process; a later call changes its threshold."""
    if threshold_secs <= 0:
        return
    if _watched:
        _watched[0] = threshold_secs
        return
    _watched.append(threshold_secs)
    started: dict[int, float] = {}

    def callback(phase: str, info: dict) -> None:
        generation = info.get("generation", -1)
        if phase == "start":
            started[generation] = time.perf_counter()
            return
        seconds = time.perf_counter() - started.pop(generation, time.perf_counter())
        if seconds > _watched[0]:
            logger.warning("a garbage collection of generation %d took %.3f s (%d objects frozen); POST /freeze_gc "
                           "after warm-up moves long-lived objects out of its reach", generation, seconds,
                           gc.get_freeze_count())

    gc.callbacks.append(callback)
