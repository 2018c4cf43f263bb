"""Which layer loop a CPU decode or verify step runs, measured per compiled shape while it serves.

The scan slices each layer's weights out of the stacked arrays, and XLA:CPU copies every slice
(~427 MB a step for SmolLM2-135M in float32) before its dots read it from cache; the switch reads
each layer's own arrays in place (`model.switch_layers`). Which is faster depends on the host,
not only on the shape: on a quiet host the copies paid for themselves at 1-8 sequences (the
switch 1.09-1.12x the scan's step, docs/performance.md section 19), on a host whose memory is
slower the copies dominate (the switch 0.68-0.83x at 1-8 sequences, section 24). So "auto" on a
CPU times both on every decode and verify shape it meets, runs the faster, and times the other again now
and then, since a host's speed drifts. A second layout is a second program per shape (the switch's
takes 2-2.5x the scan's memory mappings, `jax_backend.compiled_memory`), so near the process's
limit a new shape settles on its default layout instead (`TargetRunner`, `EXPLORE_ROOM`).
"""

from __future__ import annotations

import collections
import statistics
from typing import Hashable

# Before a decode shape is timed both ways, it runs the switch from this many sequences on (the
# scan below): the switch measured 0.82-0.93x the scan's step at 16-64 sequences on every host
# so far (docs/performance.md section 20).
AUTO_SWITCH_SEQS = 16
# A new shape's other layout is compiled only while room for this many more programs is left
# (`compiled_memory.program_room`): past it, each shape runs its default layout, one program.
EXPLORE_ROOM = 64


class LayoutTuner:
    """Per shape key: each layout for `trials` timed steps (its first step compiles and is not
    timed), then the one with the lower median of its last `window` times; every
    `recheck_every` steps of a key the others get `trials` fresh timed steps again."""

    def __init__(self, layouts: tuple[str, ...] = ("scan", "switch"), trials: int = 3, window: int = 5,
                 recheck_every: int = 128):
        if trials < 1 or window < trials or recheck_every < 1:
            raise ValueError(f"need 1 <= trials <= window and recheck_every >= 1, got {trials}, {window}, {recheck_every}")
        self.layouts, self.trials, self.window, self.recheck_every = layouts, trials, window, recheck_every
        self._times: dict[tuple[Hashable, str], collections.deque] = {}
        self._compiled: set[tuple[Hashable, str]] = set()
        self._steps: collections.Counter = collections.Counter()  # timed steps chosen per key
        self._settled: dict[Hashable, str] = {}  # keys that run one layout only (`settle`)

    def choose(self, key: Hashable, default: str, timed: bool = True) -> str:
        """The layout of the next step of shape `key`. A step that will not be timed (`timed`
        False) gets the best measured so far, else `default`, and explores nothing."""
        if key in self._settled:
            return self._settled[key]
        if not timed:
            return self.best(key) or default
        self._steps[key] += 1
        if self._steps[key] % self.recheck_every == 0:
            best = self.best(key)
            for layout in self.layouts:
                if layout != best:
                    self._times.pop((key, layout), None)
        order = (default, *[layout for layout in self.layouts if layout != default])
        for layout in order:
            if len(self._times.get((key, layout), ())) < self.trials:
                return layout
        return self.best(key) or default

    def choose_loop(self, kind: str, batch, mode: str, timed: bool, block: int = 1) -> tuple[str, tuple | None]:
        """(layer loop, key) of a TargetRunner step of `kind` ("sample" | "verify": blocks of
        `block` rows) over `batch` (`jax_backend.batch.Batch`) in sampling `mode`, keyed by its
        compiled shape. A "sample" step of more than one token per sequence is not a decode step:
        the scan (key None)."""
        if kind == "sample" and batch.max_q_len != 1:
            return "scan", None
        key = (kind, mode, batch.tokens.shape[0], batch.page_indices.shape, batch.max_q_len, block)
        default = "switch" if kind == "sample" and batch.kv_lens.shape[0] >= AUTO_SWITCH_SEQS else "scan"
        return self.choose(key, default, timed), key

    def observe(self, key: Hashable, layout: str, seconds: float) -> None:
        """A timed step of `key` ran `layout` in `seconds` (a layout's first step compiled it)."""
        if (key, layout) not in self._compiled:
            self._compiled.add((key, layout))
            return
        self._times.setdefault((key, layout), collections.deque(maxlen=self.window)).append(seconds)

    def settle(self, key: Hashable, layout: str) -> None:
        """Every step of `key` runs `layout` from now on: nothing else is compiled or timed for it."""
        self._settled[key] = layout

    def uncompiled(self, key: Hashable, layout: str) -> list[str]:
        """The layouts other than `layout` that no step of `key` has run yet (the runner compiles
        them at a shape's first step, so that exploring later compiles nothing); none for a
        settled key."""
        if key in self._settled:
            return []
        return [other for other in self.layouts if other != layout and (key, other) not in self._compiled]

    def best(self, key: Hashable) -> str | None:
        """The layout with the lowest median among those with `trials` times (None: none yet)."""
        medians = {layout: statistics.median(times) for layout in self.layouts
                   if len(times := self._times.get((key, layout), ())) >= self.trials}
        return min(medians, key=medians.get) if medians else None

    def times(self, key: Hashable) -> dict[str, list[float]]:
        """The times kept per layout for `key` (benchmarks and tests read them)."""
        return {layout: list(self._times.get((key, layout), ())) for layout in self.layouts}
