"""What passes between the HTTP layer and the tokenizer manager (SGLang's managers/io_struct.py).

The HTTP request bodies themselves (pydantic, SGLang's field names) are in
entrypoints/protocol.py; they are normalized into one `GenerateRequest` per prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sgl_dflash.sampling_params import SamplingParams


@dataclasses.dataclass
class GenerateRequest:
    """One prompt of a /generate call (a batch call becomes several)."""

    rid: str
    sampling_params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    # The client set max_new_tokens (not the default): prompt + max_new_tokens beyond the
    # context is then refused (or clipped with --allow-auto-truncate), as SGLang does.
    max_new_tokens_explicit: bool = False


@dataclasses.dataclass
class Snapshot:
    """A request's state after a scheduler step, copied in the scheduler thread (ids only: the
    text is decoded on the event-loop side)."""

    rid: str
    output_ids: list[int]
    finished_reason: dict[str, Any] | None
    meta_info: dict[str, Any]
