"""SGLang's ScheduleBatch as our ModelWorkerBatch (sgl_dflash/integrations/sglang_batch.py), on
stand-ins with the fields SGLang 0.5.23 fills (fast lane; the real thing runs in
test_sglang_server.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from sgl_dflash.integrations.sglang_batch import decode_batch, extend_batch, sampling_info
from sgl_dflash.model_executor.forward_batch_info import ForwardMode

VOCAB = 100


def req(rid, row, *, temperature=1.0, top_p=1.0, top_k=1 << 30, committed=0, output_ids=(), chunks_left=0):
    return SimpleNamespace(
        rid=rid, kv=SimpleNamespace(req_pool_idx=row, kv_committed_len=committed), output_ids=list(output_ids),
        origin_input_ids=[5], inflight_middle_chunks=chunks_left,
        sampling_params=SimpleNamespace(temperature=temperature, top_p=top_p, top_k=top_k),
    )


def req_to_token():
    table = torch.zeros((4, 32), dtype=torch.int32)
    table[1] = torch.arange(100, 132)  # row 1's positions live in slots 100..
    table[2] = torch.arange(200, 232)
    return table


def test_sampling_info_reads_sglang_normalized_params():
    # SGLang writes temperature 0 as temperature 1 + top_k 1, and "all tokens" as top_k 2**30.
    info = sampling_info([req("a", 1, top_k=1), req("b", 1, temperature=0.7, top_p=0.9, top_k=40),
                          req("c", 1, temperature=0.5)], VOCAB)
    np.testing.assert_allclose(info.temperatures, [0.0, 0.7, 0.5])
    np.testing.assert_allclose(info.top_ps, [1.0, 0.9, 1.0], rtol=1e-6)
    assert info.top_ks.tolist() == [0, 40, 0]
    assert sampling_info([req("a", 1, top_k=1)], VOCAB).is_all_greedy


def test_extend_batch_splits_chunks_and_reads_page_tables():
    batch = SimpleNamespace(
        reqs=[req("a", 1), req("b", 2, chunks_left=1)],
        input_ids=torch.tensor([1, 2, 3, 7, 8]), prefix_lens=[0, 4], extend_lens=[3, 2],
    )
    step = extend_batch(batch, req_to_token(), VOCAB)
    assert step.forward_mode is ForwardMode.EXTEND and step.slots == ["a", "b"]
    assert step.input_ids == [[1, 2, 3], [7, 8]]
    assert step.prefix_lens == [0, 4]
    assert step.page_tables == [[100, 101, 102], list(range(200, 206))]
    assert step.sample == [True, False]  # b has chunks left: its token is discarded


def test_decode_batch_runs_the_pending_token_over_reserved_slots():
    batch = SimpleNamespace(reqs=[req("a", 1, committed=6, output_ids=[9, 4]), req("b", 2, committed=3, output_ids=[7])])
    step = decode_batch(batch, req_to_token(), VOCAB, prefix_lens=[6, 3], tokens_per_step=4)
    assert step.forward_mode is ForwardMode.DECODE
    assert step.input_ids == [[4], [7]] and step.prefix_lens == [6, 3]
    assert step.page_tables == [list(range(100, 110)), list(range(200, 207))]
