"""Checks on XLA's optimized HLO: every while loop must have a trip count XLA knows.

On GPU, XLA reads a data-dependent while condition on the host every iteration (a device-to-host
copy and a stall per iteration) and cannot capture the loop in a command buffer (CUDA graph);
a loop whose trip count XLA derived statically carries `known_trip_count` in its backend config.

    python -m jax_backend.hlo_check DUMP_DIR     # after running with
    XLA_FLAGS="--xla_dump_to=DUMP_DIR --xla_dump_hlo_as_text"   # (any program, any backend)

prints each optimized module's while loops and exits 1 if any has no known trip count.
On CPU the target's attention loop stops at the longest prefix's chunks by design (a trip count
read on the device, free there: `Batch.loop_to_longest`), so a CPU dump of a step with a cached
prefix past one chunk lists that loop; programs for accelerators have none.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_WHILE = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s*=.*?\swhile\(", re.MULTILINE)


def while_loops(hlo_text: str) -> list[tuple[str, bool]]:
    """(instruction name, has a known trip count) for every while loop in an HLO module's text."""
    loops = []
    for match in _WHILE.finditer(hlo_text):
        line_end = hlo_text.find("\n", match.start())
        line = hlo_text[match.start() : line_end if line_end >= 0 else None]
        loops.append((match.group(1), '"known_trip_count"' in line))
    return loops


def unbounded_while_loops(hlo_text: str) -> list[str]:
    """Names of the while loops whose trip count XLA does not know."""
    return [name for name, known in while_loops(hlo_text) if not known]


def optimized_modules(dump_dir: str | Path) -> dict[str, str]:
    """{file name: HLO text} of every module XLA dumped after optimizations (one per program)."""
    files = sorted(Path(dump_dir).glob("*after_optimizations.txt"))
    return {f.name: f.read_text() for f in files}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__)
        return 2
    modules = optimized_modules(args[0])
    bad = 0
    for name, text in modules.items():
        loops = while_loops(text)
        unknown = [n for n, known in loops if not known]
        bad += len(unknown)
        if loops:
            print(f"{name}: {len(loops)} while loop(s), {len(unknown)} without a known trip count {unknown or ''}")
    print(f"{len(modules)} optimized modules, {bad} while loop(s) without a known trip count")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
