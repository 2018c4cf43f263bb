"""Token logprobs for `return_logprob` (SGLang's meta_info fields), computed by scoring.

The scheduler does not keep logits, so a request that asks for logprobs is scored once it has
finished: one target forward over prompt + output (logits of every position) in a borrowed
slice of the KV pool, run by the scheduler thread between two steps. The values are those of
the target model's own distribution (log-softmax of its logits, before temperature / top-p /
top-k), the same for speculative and plain decoding.

Layout, as SGLang's: `input_token_logprobs` has one entry per prompt position from
`logprob_start_len` on, the first being `None` (its logit is not computed);
`output_token_logprobs` one per generated token. Entries are `(logprob, token_id, text)`, text
only with `return_text_in_logprobs`; top-k lists `[(logprob, token_id, text), ...]` per entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jax_backend.batch import SeqInput

# Sequence id of the borrowed KV pages (never a scheduler slot, which are ints).
SCORING_SEQ_ID = "server-logprob-scoring"


@dataclasses.dataclass
class TokenScores:
    """For tokens[1:] of a scored sequence: logprob of each, and the top-k alternatives."""

    token_logprobs: np.ndarray  # [n-1] float64
    top_ids: np.ndarray  # [n-1, k] int
    top_logprobs: np.ndarray  # [n-1, k] float64


def score_tokens(worker: Any, token_ids: list[int], top_k: int) -> TokenScores | None:
    """Score `token_ids` with the target (one forward, all logits). Returns None when the KV pool
    lacks the pages right now; call again after the scheduler's next step."""
    allocator = worker.allocator
    n = len(token_ids)
    if n < 2:
        empty = np.zeros((0, 0))
        return TokenScores(np.zeros(0), empty.astype(np.int64), empty)
    if allocator.pages_needed(SCORING_SEQ_ID, n) > allocator.num_free_pages:
        return None
    allocator.allocate(SCORING_SEQ_ID, n)
    try:
        table = allocator.page_table(SCORING_SEQ_ID)
        out = worker.target.forward([SeqInput(list(token_ids), 0, table, "all")])
    finally:
        allocator.free(SCORING_SEQ_ID)
    logits = np.asarray(out.logits[0][: n - 1], np.float64)  # row j predicts token j+1
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    targets = np.asarray(token_ids[1:], np.int64)
    token_logprobs = logprobs[np.arange(n - 1), targets]
    k = min(max(top_k, 0), logprobs.shape[-1])
    top_ids = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    top_logprobs = np.take_along_axis(logprobs, top_ids, axis=-1)
    return TokenScores(token_logprobs, top_ids, top_logprobs)


def logprob_meta_info(
    scores: TokenScores,
    input_ids: list[int],
    output_ids: list[int],
    *,
    logprob_start_len: int,
    top_logprobs_num: int,
    decode_token: Any | None,
) -> dict[str, Any]:
    """SGLang's logprob fields of meta_info for a finished request; `scores` covers
    input_ids + output_ids."""
    full = input_ids + output_ids
    num_input = len(input_ids)
    start = num_input if logprob_start_len < 0 else logprob_start_len

    def unscored(position: int) -> bool:
        # Like SGLang, the first input entry has no logprob (even when start > 0).
        return position == 0 or (position == start and position < num_input)

    def entry(position: int) -> tuple[float | None, int, str | None]:
        token = full[position]
        value = None if unscored(position) else float(scores.token_logprobs[position - 1])
        return value, token, _text(decode_token, token)

    def top(position: int) -> list[tuple[float, int, str | None]] | None:
        if unscored(position):
            return None
        row = position - 1
        return [
            (float(lp), int(t), _text(decode_token, int(t)))
            for lp, t in zip(scores.top_logprobs[row], scores.top_ids[row])
        ]

    input_positions = range(start, num_input)
    output_positions = range(num_input, len(full))
    info: dict[str, Any] = {
        "input_token_logprobs": [entry(p) for p in input_positions],
        "output_token_logprobs": [entry(p) for p in output_positions],
    }
    if top_logprobs_num > 0:
        info["input_top_logprobs"] = [top(p) for p in input_positions]
        info["output_top_logprobs"] = [top(p) for p in output_positions]
    return info


def _text(decode_token: Any | None, token: int) -> str | None:
    return None if decode_token is None else decode_token(token)
