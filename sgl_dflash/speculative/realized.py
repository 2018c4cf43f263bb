"""What the adaptive policy's drafted steps realized against the plain steps they replaced, per
batch bucket: the policy's check on its own predictions (issue 14: never slower than AR).

The policy drafts where its cost model and calibration predict a gain. At 8 requests on a CPU
those predictions ran optimistic: a small drafted step was priced too cheaply, and the policy
drafted 91% of a batch's steps at 0.92x NONE's rate (docs/adaptive.md, 2026-12-02). The guard
sets every drafted step's realized tokens and seconds (its drafter work included, also the part
that ran behind the scheduler) against what a plain step would have yielded at that moment: n
tokens in the plain step's predicted seconds (a plain step is read at least every 32 steps and is
the cost model's clock). When a batch bucket's last `window` drafted steps yielded fewer tokens
per second than plain steps would have, drafting at that bucket pauses for `backoff` steps, then
is tried again on fresh readings; each loss in a row doubles the pause (up to `max_backoff`), a
window that gains resets it.

The same readings decide whether a joining request gets drafter context at a load
(`AdaptivePolicy.drafts_may_pay`). Context costs on every step, drafted or not (the drafter's
ingest and commits, the policy's work: adaptive with no drafting ran 0.95-0.98x NONE), and pays
only on the steps that draft: `context_gain` is the mean, over a bucket's last `gain_rows`
request-steps with context (a step of n requests is n of them), of the tokens a step realized
beyond what a plain step would have yielded in its seconds, per request (0 for a plain step).
Counted in request-steps, the evidence spans several requests at any load (512 are four 128-token
answers at one request, 64 steps at eight): at one request what a draft is worth is the prompt's
(1.4x on a math prompt, 0.97x on a chat one), and one chat answer must not refuse the next prompt. At 8 requests the policy drafted 6% of the steps, each
worth a few percent: its gain per step was far below what the context cost (0.92-0.94x NONE).
"""

from __future__ import annotations

import collections
import dataclasses
import logging

from jax_backend.batch import bucket

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Bucket:
    # per drafted step: (tokens it yielded, its seconds, a plain step's tokens and seconds then)
    steps: collections.deque
    gains: collections.deque  # per step with context: (n, tokens beyond a plain step's per request)
    rows: int = 0  # request-steps in `gains`
    paused_until: int = 0  # the policy's step count until which drafting waits
    losses: int = 0  # windows lost in a row


class RealizedGuard:
    def __init__(self, window: int = 16, backoff: int = 64, max_backoff: int = 1024, gain_rows: int = 512,
                 min_gain_rows: int = 256):
        self.window, self.backoff, self.max_backoff = window, backoff, max_backoff
        self.gain_rows, self.min_gain_rows = gain_rows, min_gain_rows
        self.buckets: dict[int, _Bucket] = {}

    def _bucket(self, n: int) -> _Bucket:
        key = bucket(n)
        if key not in self.buckets:
            self.buckets[key] = _Bucket(collections.deque(maxlen=self.window), collections.deque())
        return self.buckets[key]

    def paused(self, n: int, step: int) -> bool:
        """Whether drafting at n requests waits at the policy's step `step`."""
        entry = self.buckets.get(bucket(n))
        return entry is not None and step < entry.paused_until

    def ratio(self, n: int) -> float | None:
        """Tokens per second of the last drafted steps at n requests over what plain steps would
        have yielded then (None: fewer than `window` readings since the last pause)."""
        entry = self.buckets.get(bucket(n))
        if entry is None or len(entry.steps) < self.window:
            return None
        tokens, seconds, plain_tokens, plain_seconds = (sum(column) for column in zip(*entry.steps))
        return (tokens / seconds) / (plain_tokens / plain_seconds)

    def context_gain(self, n: int) -> float | None:
        """Mean realized gain per request-step with drafter context at n requests, as a fraction
        of a plain step's tokens (None: fewer than `min_gain_rows` request-steps read there)."""
        entry = self.buckets.get(bucket(n))
        if entry is None or entry.rows < self.min_gain_rows:
            return None
        return sum(rows * gain for rows, gain in entry.gains) / entry.rows

    def record_plain(self, n: int) -> None:
        """A plain step of n requests with drafter context: it gained nothing."""
        self._gain(n, 0.0)

    def _gain(self, n: int, gain: float) -> None:
        entry = self._bucket(n)
        entry.gains.append((n, gain))
        entry.rows += n
        while entry.rows - entry.gains[0][0] >= self.gain_rows:
            entry.rows -= entry.gains.popleft()[0]

    def record(self, n: int, tokens: int, seconds: float, plain_seconds: float, step: int) -> bool:
        """A drafted step of n requests yielded `tokens` in `seconds` at the policy's step `step`;
        a plain step would have taken `plain_seconds` (for n tokens). True when this reading
        pauses drafting at n requests."""
        entry = self._bucket(n)
        entry.steps.append((tokens, seconds, n, plain_seconds))
        self._gain(n, (tokens * plain_seconds / seconds - n) / n)
        ratio = self.ratio(n)
        if ratio is None:
            return False
        if ratio >= 1.0:
            entry.losses = 0
            return False
        pause = min(self.backoff << entry.losses, self.max_backoff)
        entry.paused_until, entry.losses = step + pause, entry.losses + 1
        entry.steps.clear()  # the next window is read afresh
        logger.info("adaptive: drafted steps at %d requests realized %.2fx the plain rate over %d steps; "
                    "plain steps for the next %d", bucket(n), ratio, self.window, pause)
        return True
