"""What steps with drafter context realized at each load (batch bucket): the adaptive policy's
check on its own predictions, read where it decides who keeps drafter context (issue 14: never
slower than AR).

Context costs on every step, drafted or not: the drafter's ingest of the prompt, the commit of
every token's features, the policy's work (adaptive with no drafting ran 0.95-0.98x NONE,
docs/adaptive.md 2026-11-27 night). It pays only on the steps that draft, and only where they
gain. The admission rule predicts that gain from the cost model and the acceptance observed; at 32
requests it said yes where the policy then ran every step plain, and the engine paid the context
for nothing (0.92-0.97x NONE, 2026-12-03). So every measured step with context is read here: a
drafted step's tokens beyond what a plain step would have yielded in its seconds (the step's own
seconds plus the drafter's work it left running behind the scheduler, against the plain step's
predicted seconds then), per request; 0 for a plain step. `context_gain` is their mean over the
load's last `gain_rows` request-steps (a step of n requests is n of them), once `min_gain_rows` were
read. Counted in request-steps, the evidence spans several requests at any load (512 are four
128-token answers at one request, 64 steps at eight): at one request what a draft is worth is the
prompt's (1.4x on a math prompt, 0.97x on a chat one), and one chat answer must not decide the next.

Each request's own steps with context are read too (`request_step`): a drafted request's share of
its step's gain (its accepted drafts, less its share of what the step cost beyond a plain one), 0
on a step it drafted nothing. Once `min_request_steps` were read, a request whose mean is below
what context costs (`spent`) goes on without context: at one request the load's evidence spans
answers, and a chat answer whose drafts fail paid context and failed probes to its end (0.92-0.96x
NONE on MT-Bench, docs/adaptive.md 2026-12-05 evening). It also bounds what a request given
context only to keep measuring costs its batch.

Evidence that context does not pay keeps requests at that load from drafting, so it would never be
read again; once `expire_steps` steps ran there without context, it expires and the prediction
decides again (512 steps: four 128-token answers at one request, four such batches at 32; each
expiry costs a batch's ingest and a few steps with context at a load where it does not pay).
"""

from __future__ import annotations

import collections
import dataclasses

from jax_backend.batch import bucket


@dataclasses.dataclass
class _Load:
    gains: collections.deque = dataclasses.field(default_factory=collections.deque)  # (n, gain per request)
    rows: int = 0  # request-steps in `gains`
    total: float = 0.0  # their gains summed (each step's n x its gain)
    without: int = 0  # steps without context since the last step with it


class RealizedGains:
    def __init__(self, gain_rows: int = 512, min_gain_rows: int = 256, expire_steps: int = 512,
                 min_request_steps: int = 32):
        self.gain_rows, self.min_gain_rows, self.expire_steps = gain_rows, min_gain_rows, expire_steps
        self.min_request_steps = min_request_steps
        self.loads: dict[int, _Load] = {}
        self.requests: dict[int, list[float]] = {}  # slot -> [steps read, their gains summed]

    def _load(self, n: int) -> _Load:
        return self.loads.setdefault(bucket(n), _Load())

    def context_gain(self, n: int) -> float | None:
        """Mean realized gain per request-step with drafter context at n requests, as a fraction
        of a plain step's tokens (None: fewer than `min_gain_rows` request-steps read there)."""
        load = self.loads.get(bucket(n))
        if load is None or load.rows < self.min_gain_rows:
            return None
        return load.total / load.rows

    def drafted(self, n: int, tokens: int, seconds: float, plain_seconds: float) -> None:
        """A drafted step of n requests yielded `tokens` in `seconds`; a plain step would have
        yielded n in `plain_seconds`."""
        self._read(n, (tokens * plain_seconds / seconds - n) / n)

    def plain(self, n: int) -> None:
        """A plain step of n requests with drafter context: it gained nothing."""
        self._read(n, 0.0)

    @staticmethod
    def request_gains(n: int, accepted: dict[int, int], seconds: float, plain_seconds: float) -> dict[int, float]:
        """A drafted step's gain per drafted request (slot -> drafts it accepted): with p = plain
        seconds / seconds, the step gained sum(a) p - n (1 - p) tokens over a plain step's n; each
        drafted request gets a p less an equal share of n (1 - p). At one request: (a + 1) p - 1."""
        p = plain_seconds / seconds
        return {slot: a * p - n * (1 - p) / len(accepted) for slot, a in accepted.items()}

    def request_step(self, gains: dict[int, float]) -> None:
        """One measured step of requests with drafter context: slot -> its gain (0: undrafted)."""
        for slot, gain in gains.items():
            read = self.requests.setdefault(slot, [0, 0.0])
            read[0] += 1
            read[1] += gain

    def spent(self, slot: int, cost: float) -> bool:
        """Whether the request's own steps with context (`min_request_steps` of them at least)
        realized less than `cost` (what context costs, a fraction of a step's tokens) on average."""
        steps, total = self.requests.get(slot, (0, 0.0))
        return steps >= self.min_request_steps and total < cost * steps

    def forget(self, slot: int) -> None:
        self.requests.pop(slot, None)

    def without_context(self, n: int) -> None:
        """A step of n requests none of which has drafter context; after `expire_steps` of them
        the load's evidence expires."""
        load = self._load(n)
        load.without += 1
        if load.without >= self.expire_steps:
            self.loads[bucket(n)] = _Load()

    def _read(self, n: int, gain: float) -> None:
        load = self._load(n)
        load.gains.append((n, gain))
        load.rows, load.total, load.without = load.rows + n, load.total + n * gain, 0
        while load.rows - load.gains[0][0] >= self.gain_rows:
            rows, old = load.gains.popleft()
            load.rows, load.total = load.rows - rows, load.total - rows * old
