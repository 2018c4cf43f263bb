"""Detokenization: incremental, and off the scheduler's hot path (the job of SGLang's
DetokenizerManager).

The scheduler works in token ids. Text is made where it is needed:
- streamed outputs: the tokenizer manager keeps an `IncrementalDetokenizer` per request on the
  event-loop side and feeds it each snapshot's ids; it decodes only the tokens since the last
  complete character, over a window that starts one read earlier (SGLang's surr/read offsets),
  so tokenizers whose pieces depend on their left neighbour (leading spaces, word joins) decode
  as a whole-text decode does;
- finished requests: `final_text` decodes all output ids once and cuts a matched stop string;
- stop strings: the scheduler must know at once whether a token completed one, so a request that
  has stop strings carries its own `IncrementalDetokenizer` there (O(new tokens) per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decode shows for an incomplete UTF-8 character


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """The text of a growing list of output ids, decoding only their new tail on each update."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.text = ""  # text of output_ids[:read_offset]; final (ends on a whole character)
        self.surr_offset = 0  # where the window decoded with the next tokens starts
        self.read_offset = 0  # ids whose text is in self.text

    def update(self, output_ids: Sequence[int]) -> str:
        """The text of `output_ids` (a list that only grows), as `decode` of all of them would
        give it: an incomplete last character shows as U+FFFD until its bytes arrive."""
        if len(output_ids) == self.read_offset:
            return self.text
        prefix = decode(self.tokenizer, output_ids[self.surr_offset : self.read_offset])
        tail = decode(self.tokenizer, output_ids[self.surr_offset :])[len(prefix) :]
        if tail.endswith(REPLACEMENT_CHAR):  # wait for the rest of the character
            return self.text + tail
        self.text += tail
        self.surr_offset, self.read_offset = self.read_offset, len(output_ids)
        return self.text

    def find_stop(self, output_ids: Sequence[int], stops: Sequence[str]) -> str | None:
        """Update, then the first of `stops` (in their order) the text now contains; only text
        that can hold a new match is searched (earlier text was searched on earlier updates)."""
        final_before = len(self.text)
        text = self.update(output_ids)
        for stop in stops:
            if text.find(stop, max(0, final_before - len(stop) + 1)) >= 0:
                return stop
        return None


def final_text(tokenizer: Any, output_ids: Sequence[int], finished_reason: dict[str, Any] | None) -> str:
    """A finished request's text: all output decoded once, cut before a matched stop string."""
    text = decode(tokenizer, output_ids)
    matched = (finished_reason or {}).get("matched")
    if isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text
