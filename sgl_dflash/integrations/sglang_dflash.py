"""SGLang's DFLASH speculative worker, running our `DFlashWorker` (JAX target + torchax drafter).

`DFlashJaxPlatform.get_speculative_worker_cls("DFLASH")` returns `DFlashSpecWorker`; SGLang's
scheduler (`maybe_init_draft_worker`) builds it with `server_args, gpu_id, nccl_port,
target_worker` (our `JaxTpModelWorker`, whose `engine` is the `DFlashWorker`: one JAX target that
records the drafter's aux layers) and drives it synchronously (overlap is off) through SGLang's
spec-v2 contract, as SGLang's own `DFlashWorkerV2` (speculative/dflash_worker_v2.py):

- EXTEND (a prefill or prefill chunk): the target runs the chunk; the chunk's aux features are
  collected per request and, at the final chunk, become the drafter's context. Returns the first
  token per request (`next_token_ids`), `new_seq_lens = batch.seq_lens`, and the next draft input.
- DECODE: before it, SGLang calls `batch.spec_info.prepare_for_decode(batch)` on our
  `DFlashDraftState`, which reserves the verify block's B KV slots past each request's committed
  length (`req.kv.kv_committed_len`) in SGLang's `req_to_token`, on the CPU. Then one draft ->
  verify -> accept -> commit step of `DFlashWorker.forward_decode`; returns `next_token_ids`
  [bs * B] (row i: its accepted drafts, then the bonus), `accept_lens` [bs] (= accepted + 1),
  `new_seq_lens` (committed + accept_lens) and `speculative_num_draft_tokens = B`. SGLang's
  result processor (`_resolve_spec_v2_tokens`) appends those tokens, advances
  `kv_committed_len`, applies stop rules and counts spec_verify_ct / accept lengths (meta_info).

Drafter state is keyed by SGLang's rid and released when the request finishes
(`note_request_finished`, BaseSpecWorker's hook), and otherwise at the next step once SGLang
marks the request finished (an abort, a finish at prefill) or retracted (`req.is_retracted`;
its re-prefill starts from scratch).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.allocation import alloc_token_slots
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from sgl_dflash.integrations.sglang_batch import decode_batch, extend_batch

logger = logging.getLogger(__name__)


class DFlashDraftState(SpecInput):
    """What SGLang carries on `batch.spec_info` between our steps. Per-request state (pending token,
    committed length) lives on SGLang's `Req`s, so filtering and merging batches has nothing to do."""

    def __init__(self, block_size: int):
        super().__init__(SpecInputType.DFLASH_DRAFT)
        self.block_size = block_size
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    def prepare_for_decode(self, batch: Any) -> None:
        """Reserve KV slots up to committed + B for every request (the verify block writes B)."""
        reqs = batch.reqs
        if not reqs:
            return
        ranges = []
        for req in reqs:
            start = int(req.kv.kv_allocated_len)
            ranges.append((start, max(start, int(req.kv.kv_committed_len) + self.block_size)))
        needed = sum(end - start for start, end in ranges)
        if needed:
            slots = alloc_token_slots(batch.tree_cache, needed).to(torch.int32)
            offset = 0
            for req, (start, end) in zip(reqs, ranges):
                batch.req_to_token_pool.write((req.kv.req_pool_idx, slice(start, end)), slots[offset : offset + end - start])
                offset += end - start
        committed = torch.tensor([int(req.kv.kv_committed_len) for req in reqs], dtype=torch.int64)
        for req, (_, end) in zip(reqs, ranges):
            req.kv.kv_allocated_len = end
            req.decode_batch_idx += 1
        batch.seq_lens_cpu = committed
        batch.seq_lens_sum = int(committed.sum())

    def filter_batch(self, new_indices: Any, new_indices_cpu: Any = None) -> None:
        pass

    def merge_batch(self, spec_info: Any) -> None:
        pass


class DFlashSpecWorker(BaseSpecWorker):
    def __init__(self, server_args: Any, gpu_id: int = 0, nccl_port: int = 0, target_worker: Any = None,
                 **kwargs: Any):
        super().__init__()
        from sgl_dflash.speculative.dflash_worker import DFlashWorker

        engine = getattr(target_worker, "engine", None)
        if not isinstance(engine, DFlashWorker):
            raise RuntimeError("DFLASH on the dflash_jax platform needs its JaxTpModelWorker (the "
                               "sgl-dflash general plugin did not run in the scheduler process?)")
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None  # the drafter is ours, not an SGLang model runner
        self.engine = engine
        self.block_size = engine.block_size
        self.device = torch.device("cpu")
        self._reqs: dict[str, Any] = {}  # rid -> SGLang Req holding drafter state or chunk features
        self._chunks: dict[str, list[np.ndarray]] = {}  # rid -> aux features of its prefill chunks

    def __getattr__(self, name: str) -> Any:
        # Like SGLang's DFlashWorkerV2: whatever the scheduler asks and we do not define is the
        # target worker's. (The guard avoids recursing before __init__ has set it.)
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self._target_worker.model_runner.req_to_token_pool.req_to_token

    def forward_batch_generation(self, batch: Any, on_publish: Any = None, grammar_barrier: Any = None,
                                 pp_proxy_tensors: Any = None) -> GenerationBatchResult:
        self._release_gone_requests()
        if batch.forward_mode.is_idle() or not batch.reqs:
            return self._result(torch.zeros(0, dtype=torch.long), batch.seq_lens)
        if batch.forward_mode.is_extend():
            return self._extend(batch)
        if batch.forward_mode.is_decode():
            return self._decode(batch)
        raise NotImplementedError(f"the dflash_jax platform does not run forward mode {batch.forward_mode}")

    def _extend(self, batch: Any) -> GenerationBatchResult:
        step = extend_batch(batch, self.req_to_token, self.engine.vocab_size)
        result, out = self.engine.target_worker.forward_extend(step)
        for i, req in enumerate(batch.reqs):
            if step.prefix_lens[i] == 0:  # a new request, or a retracted one computed again
                self._release(req.rid)
            features = out.features[i]
            self._chunks.setdefault(req.rid, []).append(features)
            self._reqs[req.rid] = req
            if step.sample[i]:  # the prompt is complete: the drafter gets all of it
                self.engine.add_context(req.rid, np.concatenate(self._chunks.pop(req.rid)))
        tokens = torch.from_numpy(result.next_token_ids[:, 0].astype(np.int64))
        return self._result(tokens, batch.seq_lens)

    def _decode(self, batch: Any) -> GenerationBatchResult:
        committed = [int(req.kv.kv_committed_len) for req in batch.reqs]
        step = decode_batch(batch, self.req_to_token, self.engine.vocab_size, committed, self.block_size)
        result = self.engine.forward_decode(step)
        accept_lens = torch.from_numpy(result.num_new_tokens.astype(np.int32))
        new_seq_lens = torch.tensor(committed, dtype=torch.int64) + accept_lens.to(torch.int64)
        tokens = torch.from_numpy(result.next_token_ids.astype(np.int64)).reshape(-1)
        output = self._result(tokens, new_seq_lens)
        output.accept_lens = accept_lens
        output.speculative_num_draft_tokens = self.block_size
        return output

    def _result(self, tokens: torch.Tensor, new_seq_lens: Any) -> GenerationBatchResult:
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None), next_token_ids=tokens,
            can_run_cuda_graph=False, new_seq_lens=new_seq_lens,
            next_draft_input=DFlashDraftState(self.block_size),
        )

    # -- per-request drafter state ----------------------------------------------------------
    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self._release(rid)

    def _release_gone_requests(self) -> None:
        """Requests SGLang finished (an abort, a finish at prefill) or retracted since the last step."""
        for rid, req in list(self._reqs.items()):
            if req.finished() or req.is_retracted:
                self._release(rid)

    def _release(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self._chunks.pop(rid, None)
        self.engine.release(rid)
