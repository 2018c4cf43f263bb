"""SGLang's `ScheduleBatch` as our seam's `ModelWorkerBatch` (model_executor/forward_batch_info.py).

SGLang owns the token slots: its `ReqToTokenPool.req_to_token[row, pos]` is the KV slot of
position `pos` of the request in `row`, filled by its allocator. With page size 1, slot s is our
KV page s, so a request's page table is simply `req_to_token[row, :length]` (SGLang never hands
out slot 0, which our pool keeps as scratch). Our workers key per-request state by SGLang's rid.

What we read from SGLang (sglang 0.5.23, managers/schedule_batch.py): `batch.reqs`,
`batch.input_ids` (EXTEND: the chunk tokens of every request, flattened), `batch.prefix_lens`,
`batch.extend_lens`, `req.kv.req_pool_idx`, `req.kv.kv_committed_len`, `req.output_ids`,
`req.inflight_middle_chunks` (> 0 while a chunked prefill has chunks left), `req.sampling_params`
(temperature, top_p, top_k; SGLang writes greedy as top_k == 1).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sgl_dflash.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch, SamplingBatchInfo


def sampling_info(reqs: list[Any], vocab_size: int) -> SamplingBatchInfo:
    """Our sampling arrays from SGLang's normalized SamplingParams (greedy: temperature 0)."""
    temperatures, top_ps, top_ks = [], [], []
    for req in reqs:
        p = req.sampling_params
        greedy = p.top_k == 1 or p.temperature <= 1e-6
        temperatures.append(0.0 if greedy else float(p.temperature))
        top_ps.append(float(p.top_p))
        top_ks.append(0 if greedy or p.top_k < 0 or p.top_k >= vocab_size else int(p.top_k))
    return SamplingBatchInfo(
        np.array(temperatures, np.float32), np.array(top_ps, np.float32), np.array(top_ks, np.int32)
    )


def is_final_chunk(req: Any) -> bool:
    """False for a chunked prefill's chunk with more to come (its sampled token is discarded)."""
    return req.inflight_middle_chunks <= 0


def pending_token(req: Any) -> int:
    """A decoding request's last token: sampled, not yet in the KV cache."""
    return int(req.output_ids[-1]) if req.output_ids else int(req.origin_input_ids[-1])


def extend_batch(batch: Any, req_to_token: Any, vocab_size: int) -> ModelWorkerBatch:
    """A prefill (or prefill-chunk) step: each request's chunk runs after its `prefix_len` cached
    tokens; only final chunks sample."""
    flat = batch.input_ids.tolist()
    input_ids, page_tables, offset = [], [], 0
    for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        input_ids.append(flat[offset : offset + extend])
        offset += extend
        page_tables.append(req_to_token[req.kv.req_pool_idx, : prefix + extend].tolist())
    return ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND,
        slots=[req.rid for req in batch.reqs],
        input_ids=input_ids,
        prefix_lens=[int(p) for p in batch.prefix_lens],
        page_tables=page_tables,
        sample=[is_final_chunk(req) for req in batch.reqs],
        sampling_info=sampling_info(batch.reqs, vocab_size),
    )


def decode_batch(batch: Any, req_to_token: Any, vocab_size: int, prefix_lens: list[int],
                 tokens_per_step: int) -> ModelWorkerBatch:
    """A decode step: each request runs its pending token (plus drafts: `tokens_per_step` KV slots
    in all) at position prefix_lens[i]; SGLang allocated those slots before the step."""
    return ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE,
        slots=[req.rid for req in batch.reqs],
        input_ids=[[pending_token(req)] for req in batch.reqs],
        prefix_lens=prefix_lens,
        page_tables=[
            req_to_token[req.kv.req_pool_idx, : length + tokens_per_step].tolist()
            for req, length in zip(batch.reqs, prefix_lens)
        ],
        sample=[True] * len(batch.reqs),
        sampling_info=sampling_info(batch.reqs, vocab_size),
    )
