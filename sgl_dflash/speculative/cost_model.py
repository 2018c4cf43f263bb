"""The adaptive policy's cost model: what a decode step costs, from running statistics.

A verify step's cost is a property of its compiled shape, which `step_shape` computes exactly as
`jax_backend.batch.build_batch` pads it: S sequences, T token rows (>= 2), Q the longest block
(the attention's dense query block), all powers of two. Every step the worker reports the
seconds its verify, draft and the rest took; each shape keeps the median of its last `window`
measurements (robust to the outliers a shared machine produces, a garbage collection or another
process's burst, which a running mean would carry for many steps; a window follows a drifting load
or a growing context). A shape not measured yet
is predicted from the measured ones with a line in T (a step reads the weights once and then
pays per row: a + b*T, least squares over the measured shapes; with measurements at a single T
the slope assumes a step costs `prior_rows` rows of work before its first). Before any
measurement the same prior gives relative costs, which is all a ratio of tokens per second needs.
The draft cost is kept per (drafter batch bucket, draft block) the same way: the policy may draft
a shorter block than the drafter's (fewer mask positions, a cheaper drafter step).

The machine's speed is the clock. It drifts (a shared host ran 1.5x slower for minutes, and
step to step by +-15%), and a program is measured only while the policy runs it: a drafted shape
read while the machine was slow and compared with a plain step read later at full speed looked too
costly and was never chosen, hence never read, again. So every reading is stored divided by the
machine's speed at that moment, and predicted multiplied by its speed now. The speed is the median
of the last `speed_window` readings of any program with a settled cost (at least
`min_clock_readings` readings), each divided by that program's stored cost: every step reads it,
drafted or plain, so a slow spell moves all predictions together within a few steps. (Until
2026-11-27 the clock was the plain step of the batch bucket, read only on plain steps: at 32
requests a drafted step's readings from a slow spell were scaled by plain readings from a fast
one, the drafted step was predicted at 1.48x a plain step (median) where it measured 1.34x, and
the policy ran 14 of 73 steps plain, at 93 tokens/s against its drafted steps' 112.)
"""

from __future__ import annotations

import collections
import statistics

import numpy as np

from jax_backend.batch import bucket

MIN_TOKEN_ROWS = 2  # TargetRunner pads every batch to >= 2 token rows (see TargetRunner._batch)


def step_shape(q_lens: np.ndarray) -> tuple[int, int, int]:
    """(S, T, Q) buckets of a packed batch whose sequences run q_lens tokens each."""
    q_lens = np.asarray(q_lens)
    return shape_of(len(q_lens), int(q_lens.sum()), int(q_lens.max()))


def shape_of(num_seqs: int, num_tokens: int, longest: int) -> tuple[int, int, int]:
    """`step_shape` from counts: n sequences of `num_tokens` tokens in all, the longest `longest`."""
    tokens = bucket(num_tokens, MIN_TOKEN_ROWS)
    return bucket(num_seqs), tokens, min(bucket(longest), tokens)


class CostModel:
    def __init__(self, window: int = 9, decay: float = 0.2, prior_rows: float = 16.0, unit: float = 1e-3,
                 stale_after: int = 256, min_clock_readings: int = 3, speed_window: int = 9):
        self.window = window  # measurements per shape whose median is its cost
        # A measurement this many steps old is stale: the machine's speed drifts (2x over minutes
        # on a shared host) while a shape that stopped being chosen is never measured again. A
        # stale shape counts as unmeasured for exploration, and its old samples are dropped when
        # it is measured again (else one fresh sample could not move a median of nine).
        self.stale_after = stale_after
        self.decay = decay  # weight of a new measurement in the running means (overhead, compiles)
        self.prior_rows = prior_rows
        # A program's readings tell the machine's speed from this many on (a median of 1-2 is one
        # outlier: batch 32's first plain step read 310 ms against ~170, and for 60 steps every
        # drafted reading was stored against that clock, then predicted 27% too cheap once it settled).
        self.min_clock_readings = min_clock_readings
        # The machine's speed now (1.0: as fast as when the first programs were read): the median
        # of the last `speed_window` readings of settled programs over their stored costs.
        self._speeds: collections.deque = collections.deque(maxlen=speed_window)
        self.speed = 1.0
        self.unit = unit  # seconds per row before anything is measured (only ratios matter then)
        # The medians as last measured (drafted shapes and drafts: see `_current` for today's).
        self.verify_s: dict[tuple[int, int, int], float] = {}
        self.draft_s: dict[tuple[int, int], float] = {}  # (batch bucket, draft block) -> seconds
        # ("verify" | "draft", key) -> seconds read by the startup sweep (`startup_reading`)
        self.startup: dict[tuple[str, tuple], float] = {}
        # ("verify" | "draft", key) -> its last readings, each divided by the speed when it was read
        self._samples: dict[tuple[str, tuple], collections.deque] = {}
        self._memo: dict[tuple[str, tuple], float] = {}  # `_current` until the next measurement
        self.overhead = 0.0
        # Shapes that ran (compiled) and what a step that compiled took: a shape never run costs
        # a compile first, which the policy spreads over the steps still to come. A program is
        # compiled per context too: a verify shape per page-table width (the target's context
        # bucket), a draft per drafter window. Seen as one, every shape the policy had used at
        # contexts under 256 tokens compiled again past them, unforeseen: at 8 requests and 256
        # new tokens, 20 steps compiled for 28 s and the engine ran at 0.44x NONE.
        self.width, self.draft_window = 0, 0  # the context of the step being planned (`at`)
        self._compiled_verify: dict[int, set[tuple[int, int, int]]] = collections.defaultdict(set)
        self._compiled_draft: dict[int, set[tuple[int, int]]] = collections.defaultdict(set)
        self._steps_at: collections.Counter = collections.Counter()  # steps run per width
        self.compile_s = 1.0
        self._compiles = 0
        self._steps = 0
        self._measured_at: dict[tuple[str, tuple], int] = {}  # ("verify" | "draft", key) -> step last measured
        self._line: tuple[float, float] | None = None  # (a, b) of the fit; None = refit

    # -- context ----------------------------------------------------------------------------
    def at(self, width: int, draft_window: int) -> None:
        """The next step runs at this page-table width (target) and drafter window: what is
        compiled, and how many steps ran here, is read there."""
        self.width, self.draft_window = width, draft_window

    @property
    def compiled_verify(self) -> set[tuple[int, int, int]]:
        """The verify shapes (S, T, Q) compiled at the current width."""
        return self._compiled_verify[self.width]

    @property
    def compiled_draft(self) -> set[tuple[int, int]]:
        """The drafts (batch bucket, block) compiled at the current drafter window."""
        return self._compiled_draft[self.draft_window]

    def drafts_compiled_at(self, window: int) -> set[tuple[int, int]]:
        return self._compiled_draft[window]

    def steps_here(self) -> int:
        """Steps run (measured or compiling) at the current width."""
        return self._steps_at[self.width]

    # -- measurements ---------------------------------------------------------------------
    def _update(self, table: dict, name: str, key: tuple, seconds: float) -> None:
        samples = self._samples.setdefault((name, key), collections.deque(maxlen=self.window))
        if not self.fresh(name, key):
            samples.clear()
        settled = statistics.median(samples) if len(samples) >= self.min_clock_readings else 0.0
        if settled > 0 and seconds > 0:  # a settled program's reading: how fast is the machine now?
            self._speeds.append(seconds / settled)
            self.speed = statistics.median(self._speeds)
        samples.append(seconds / self.speed)
        self._measured_at[(name, key)] = self._steps
        self._memo.clear()
        table[key] = self._current(name, key)

    def startup_reading(self, name: str, key: tuple, seconds: float) -> None:
        """A program timed before serving (the startup sweep; "verify": a shape, "draft": (batch
        bucket, block)). It prices the program until a step runs it, as a ratio: the sweep runs on
        an idle machine with dummy sequences sharing their pages, and serving read its programs at
        0.8-1.3x their readings (docs/adaptive.md 2026-12-04); taken as measurements, such readings
        had the policy drafting on them (2026-11-29, late night). So a reading is scaled by what served programs read over their own startup
        readings (`_startup_scale`). Not a measurement: no step, age or speed."""
        self.startup[(name, key)] = seconds
        self._memo.clear()

    def _startup_scale(self, batch: int | None) -> float:
        """Served over startup seconds: of the plain step of `batch` (a verify shape's batch
        bucket) where both were read, else the median over every program with both (1.0: none)."""
        memo = ("startup scale", (batch,))
        if memo not in self._memo:  # (until the next measurement, like `_current`)
            plain = None if batch is None else step_shape(np.ones(batch, np.int64))
            if plain in self.verify_s and ("verify", plain) in self.startup:
                scale = self._current("verify", plain) / max(self.startup[("verify", plain)], 1e-9)
            else:
                ratios = [self._current(name, key) / max(seconds, 1e-9) for (name, key), seconds in self.startup.items()
                          if key in (self.verify_s if name == "verify" else self.draft_s)]
                scale = float(statistics.median(ratios)) if ratios else 1.0
            self._memo[memo] = scale
        return self._memo[memo]

    def readings(self, shape: tuple[int, int, int]) -> int:
        """How many current measurements this verify shape's cost is the median of."""
        return len(self._samples.get(("verify", shape), ()))

    def _current(self, name: str, key: tuple) -> float:
        """The median of a program's readings at the machine's speed now."""
        if (name, key) not in self._memo:  # (a plan asks for the same few shapes many times)
            self._memo[(name, key)] = float(statistics.median(self._samples[(name, key)])) * self.speed
        return self._memo[(name, key)]

    def observe(self, shape: tuple[int, int, int], verify_s: float, draft_batch: int, draft_s: float,
                overhead_s: float, draft_block: int = 0) -> None:
        """One step: its verify shape and seconds, the drafter's batch (0: no draft), block and
        seconds, and the rest of the worker's step."""
        self._update(self.verify_s, "verify", shape, verify_s)
        self._line = None
        self.compiled_verify.add(shape)
        if draft_batch:
            self._update(self.draft_s, "draft", (bucket(draft_batch), draft_block), draft_s)
            self.compiled_draft.add((bucket(draft_batch), draft_block))
        self.overhead = overhead_s if not self._steps else (1 - self.decay) * self.overhead + self.decay * overhead_s
        self._steps += 1
        self._steps_at[self.width] += 1

    def compiled(self, shape: tuple[int, int, int], draft_batch: int, draft_block: int, seconds: float) -> None:
        """A step that compiled: not a measurement of its shape, but the shape is compiled now,
        and `seconds` (the whole step) tells what a compile costs."""
        self.compiled_verify.add(shape)
        if draft_batch:
            self.compiled_draft.add((bucket(draft_batch), draft_block))
        self.observe_compile(seconds)
        self._steps_at[self.width] += 1

    def observe_compile(self, seconds: float) -> None:
        """A program's compile (and first run) took `seconds` (a step that compiled, or the startup
        sweep: what a compile costs on this machine)."""
        self.compile_s = seconds if not self._compiles else (1 - self.decay) * self.compile_s + self.decay * seconds
        self._compiles += 1

    def age(self, shape: tuple[int, int, int], name: str = "verify") -> int | None:
        """Measured steps since this verify shape (or draft key) was last measured (None: never)."""
        step = self._measured_at.get((name, shape))
        return None if step is None else self._steps - step

    def fresh(self, name: str, key: tuple) -> bool:
        """Measured within `stale_after` steps ("verify": a shape; "draft": (batch bucket, block))."""
        age = self.age(key, name)
        return age is not None and age < self.stale_after

    # -- predictions ----------------------------------------------------------------------
    def verify(self, shape: tuple[int, int, int]) -> float:
        """Seconds of a verify step of this (S, T, Q) shape."""
        if shape in self.verify_s:
            return self._current("verify", shape)
        if ("verify", shape) in self.startup:
            return self.startup[("verify", shape)] * self._startup_scale(shape[0])
        a, b = self.line()
        return a + b * shape[1]

    def line(self) -> tuple[float, float]:
        """(a, b): predicted seconds a + b*T of a step with T token rows."""
        if self._line is None:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float]:
        if not self.verify_s:
            return self.prior_rows * self.unit, self.unit
        rows = np.array([shape[1] for shape in self.verify_s], np.float64)
        seconds = np.array([self._current("verify", shape) for shape in self.verify_s], np.float64)
        if len(np.unique(rows)) < 2:
            b = seconds.mean() / (self.prior_rows + rows.mean())
            return self.prior_rows * b, b
        b, a = np.polyfit(rows, seconds, 1)
        if b <= 0 or a < 0:  # noise: keep a non-negative line through the mean
            b = max(b, 0.0)
            a = max(seconds.mean() - b * rows.mean(), 0.0)
        return float(a), float(b)

    def draft(self, batch: int, block: int) -> float:
        """Seconds of a draft step of `block` tokens for `batch` requests (bucketed like the
        drafter's batch)."""
        key = (bucket(batch), block)
        if key in self.draft_s:
            return self._current("draft", key)
        if ("draft", key) in self.startup:
            return self.startup[("draft", key)] * self._startup_scale(None)
        if self.draft_s:  # the nearest measured one, scaled by the square root of the work ratio
            near = min(self.draft_s, key=lambda k: abs(np.log2(k[0] * k[1] / (key[0] * key[1]))))
            return self._current("draft", near) * float(np.sqrt(key[0] * key[1] / (near[0] * near[1])))
        return 0.1 * self.verify(step_shape(np.ones(batch)))  # a guess until the first draft
