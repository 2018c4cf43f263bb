"""Token logprobs for `return_logprob`, in SGLang's meta_info layout.

The scheduler does not keep logits, so a request that asks for logprobs is scored once it has
finished: the tokenizer manager asks the worker (`Scheduler.score` -> `TargetWorker.score`, one
target forward over prompt + output, run by the scheduler thread between two steps). The values
are those of the target model's own distribution (log-softmax of its logits, before temperature /
top-p / top-k), the same for speculative and plain decoding.

Layout, as SGLang's: `input_token_logprobs` has one entry per prompt position from
`logprob_start_len` on, the first being `None` (its logit is not computed);
`output_token_logprobs` one per generated token. Entries are `(logprob, token_id, text)`, text
only with `return_text_in_logprobs`; top-k lists `[(logprob, token_id, text), ...]` per entry.
"""

from __future__ import annotations

from typing import Any

from sgl_dflash.model_executor.forward_batch_info import TokenScores


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
