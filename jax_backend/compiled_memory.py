"""How many more compiled programs this process can hold before Linux refuses to map them.

XLA:CPU maps each compiled kernel as its own code, constant and data areas (three memory
mappings), and a step of the SmolLM2 target has ~80 kernels: an adaptive DFLASH engine's startup
sweep of 142 programs took 34,500 mappings (~243 a program). Linux allows `vm.max_map_count` per
process (65,530 by default); past it LLVM fails ("Cannot allocate memory") and the process dies,
every request with it. A second adaptive engine in one process met that mid-sweep (2026-11-29).
So what compiles programs on its own initiative (the sweep, the adaptive policy's exploration,
the layer-loop tuner's second layout of a shape) asks `program_room` first; programs a request
cannot run without still compile.
"""

from __future__ import annotations

from pathlib import Path

MAPS_PER_PROGRAM = 250  # a target step's ~80 kernels x 3 mappings, rounded up
_LIMIT_FILE = Path("/proc/sys/vm/max_map_count")
_MAPS_FILE = Path("/proc/self/maps")


def map_limit() -> int | None:
    """The kernel's per-process limit on memory mappings (None where there is none to read)."""
    try:
        return int(_LIMIT_FILE.read_text())
    except (OSError, ValueError):
        return None


def maps_in_use() -> int | None:
    """Memory mappings this process holds now (None off Linux). Reads ~35,000 lines in an adaptive
    engine's process (~10 ms): ask after a compile, not every step."""
    try:
        with _MAPS_FILE.open("rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def program_room() -> int | None:
    """Programs that still fit under the limit, at `MAPS_PER_PROGRAM` each (None: no limit known)."""
    limit, used = map_limit(), maps_in_use()
    if limit is None or used is None:
        return None
    return max(0, limit - used) // MAPS_PER_PROGRAM
