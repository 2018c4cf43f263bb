"""Continuous-batching scheduler: decides which requests run each step, and is the only place
where a step's result touches a request.

Each `step()` is either a prefill (EXTEND) of newly admitted requests or one decode step for every
running request (prefill first, like nano-vllm / SGLang without mixed chunks): the scheduler hands
the worker a `ModelWorkerBatch` and applies the `GenerationBatchResult` it returns
(`process_batch_result`: stop rules, statistics, aux rows). Requests join and leave between
steps. The KV page budget is enforced here (pages are jax_backend's, through the worker's
allocator):
- a waiting request is admitted only when its prompt plus one decode step fits in free pages
  (with a little headroom for the running requests to grow);
- before a decode step every running request gets pages for `committed_len + tokens_per_step`;
  when that fails the newest running request is retracted: its pages and drafter state are freed
  and it goes back to the front of the queue with its generated tokens kept, to be recomputed by a
  later prefill. A single request always fits (its length is clipped at admission), so this ends.
A request that raises while being run is finished with an error; the others carry on.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any

from sgl_dflash import compilation_cache
from sgl_dflash.errors import InvalidRequestError
from sgl_dflash.managers import gc_control
from sgl_dflash.managers.detokenizer_manager import IncrementalDetokenizer
from sgl_dflash.managers.schedule_batch import Req, ScheduleBatch
from sgl_dflash.model_executor.forward_batch_info import ForwardMode, GenerationBatchResult, TokenScores
from sgl_dflash.model_config import eos_token_ids
from sgl_dflash.server_args import ServerArgs
from sgl_dflash.speculative.spec_algorithm import SpeculativeAlgorithm
from sgl_dflash.tokenizer_utils import get_tokenizer

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args.check()
        logging.getLogger("sgl_dflash").setLevel(server_args.log_level.upper())
        self.compilation_cache_dir = compilation_cache.enable(server_args.compilation_cache_dir)
        self.algorithm = SpeculativeAlgorithm.from_string(server_args.speculative_algorithm)
        self.tokenizer = None if server_args.skip_tokenizer_init else get_tokenizer(
            server_args.resolved_tokenizer_path
        )
        self.eos_token_ids = eos_token_ids(server_args.model_path, self.tokenizer)
        self.worker = self.algorithm.create_worker(server_args)
        self.allocator = self.worker.allocator
        self.total_pages = self.allocator.num_free_pages
        # Longest sequence one request may reach: fits the context and, alone, the KV pool
        # (a decode step writes `tokens_per_step` slots past the committed length).
        capacity = self.total_pages * server_args.page_size - self.worker.tokens_per_step + 1
        self.max_req_len = min(server_args.context_length, capacity)

        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self._finished_outside_step: list[Req] = []  # aborted between steps, reported by step()
        # Slot = the sequence id of a running request in the KV allocator and drafter state.
        self._free_slots = list(range(server_args.max_running_requests))[::-1]
        self._lock = threading.RLock()
        self.stats = collections.Counter()
        gc_control.warn_on_long_passes(server_args.gc_warning_threshold_secs)

    # -- requests in and out --------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; raises `InvalidRequestError` (a ValueError) for one we cannot run."""
        self.validate_request(req)
        with self._lock:
            if any(r.rid == req.rid for r in self._all_requests()):
                raise InvalidRequestError(f"request id {req.rid!r} is already in use")
            self.stats["num_requests"] += 1
            self.stats["prompt_tokens"] += len(req.input_ids)
            if req.sampling_params.stop_strs and self.tokenizer is not None:
                req.stop_detokenizer = IncrementalDetokenizer(self.tokenizer)
            if req.sampling_params.max_new_tokens == 0:
                req.finish({"type": "length", "length": 0})
                self._finished_outside_step.append(req)
            else:
                self.waiting.append(req)

    def validate_request(self, req: Req) -> None:
        req.sampling_params.verify(self.worker.vocab_size)
        ids = req.input_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty (no input tokens)")
        vocab = self.worker.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"input_ids contain invalid token ids {bad[:5]} (vocab size {vocab})")
        if len(ids) >= self.max_req_len:
            raise InvalidRequestError(
                f"the input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.max_req_len} tokens)"
            )
        # Like SGLang: clip max_new_tokens to what the context can still hold.
        room = self.max_req_len - len(ids)
        if req.sampling_params.max_new_tokens > room:
            req.sampling_params.max_new_tokens = room

    def abort_request(self, rid: str) -> bool:
        """Finish request `rid` now (pages freed at once). False when it is unknown or done."""
        with self._lock:
            for req in list(self.waiting):
                if req.rid == rid:
                    self.waiting.remove(req)
                    break
            else:
                req = next((r for r in self.running if r.rid == rid), None)
                if req is None:
                    return False
                self._release(req)
                self.running.remove(req)
            req.abort("aborted by the client", status_code=499)
            self.stats["num_finished"] += 1
            self._finished_outside_step.append(req)
            return True

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.running or self._finished_outside_step)

    # -- one scheduling step --------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one prefill or decode step; returns the requests that got tokens or finished."""
        with self._lock:
            progressed, self._finished_outside_step = self._finished_outside_step, []
            batch = self._admit()
            if batch:
                self.run_batch(ScheduleBatch(batch, ForwardMode.EXTEND))
            else:
                batch = self._reserve_decode_pages()
                if batch:
                    self.run_batch(ScheduleBatch(batch, ForwardMode.DECODE))
                    self.stats["decode_steps"] += 1
            for req in batch:
                if req.finished:
                    self._finish(req)
            return progressed + [r for r in batch if r not in progressed]

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        prefill_tokens = 0
        growth = math.ceil(self.worker.tokens_per_step / self.server_args.page_size)
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            num_tokens = len(req.input_ids) + max(0, len(req.output_ids) - 1)
            if admitted and prefill_tokens + num_tokens > self.server_args.max_prefill_tokens:
                break
            slot = self._free_slots[-1]
            need = self.allocator.pages_needed(slot, num_tokens + self.worker.tokens_per_step)
            headroom = growth * (len(self.running) + len(admitted))
            if need + headroom > self.allocator.num_free_pages:
                break
            self.waiting.popleft()
            req.slot = self._free_slots.pop()
            self.allocator.allocate(slot, num_tokens + self.worker.tokens_per_step)
            admitted.append(req)
            prefill_tokens += num_tokens
        self.running += admitted
        return admitted

    def _reserve_decode_pages(self) -> list[Req]:
        """Pages for one decode step of every running request, retracting the newest if short."""
        for req in list(self.running):
            if req not in self.running:  # retracted below while serving an older request
                continue
            need = req.committed_len + self.worker.tokens_per_step
            while self.allocator.pages_needed(req.slot, need) > self.allocator.num_free_pages:
                victim = self.running[-1]
                self._retract(victim)
                if victim is req:
                    break
            else:
                self.allocator.allocate(req.slot, need)
        return list(self.running)

    def _retract(self, req: Req) -> None:
        logger.info("retracting %s (KV pages short): it will be recomputed", req.rid)
        self._release(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        req.num_retractions += 1
        self.stats["num_retractions"] += 1

    def run_batch(self, batch: ScheduleBatch) -> None:
        """Run a batch on the worker and apply its result; if it raises, run its requests one by
        one so only the culprit fails."""
        try:
            result = self.worker.forward_batch_generation(batch.get_model_worker_batch(self.allocator.page_table))
        except Exception as e:
            phase = batch.forward_mode.value
            if len(batch.reqs) == 1:
                logger.exception("%s failed for request %s", phase, batch.reqs[0].rid)
                batch.reqs[0].abort(f"internal error during {phase}: {type(e).__name__}: {e}")
                return
            logger.warning("%s of %d requests failed (%s); isolating the failure", phase, len(batch.reqs), e)
            for req in batch.reqs:
                if not req.finished:
                    self.run_batch(ScheduleBatch([req], batch.forward_mode))
            return
        self.process_batch_result(batch, result)

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """Apply a step's result to its requests: new tokens through the stop rules (which may cut
        a verified block), speculative statistics, aux rows. Errors finish only that request."""
        for i, req in enumerate(batch.reqs):
            try:
                if result.aux_hidden_states is not None:
                    if batch.forward_mode is ForwardMode.EXTEND:  # a retracted request is recomputed
                        req.aux_hidden = [result.aux_hidden_states[i]]
                    else:
                        req.aux_hidden.append(result.aux_hidden_states[i])
                if result.num_draft_tokens:
                    req.init_spec_stats(result.num_draft_tokens)
                if result.accept_lens is not None:
                    verified = result.num_draft_tokens if result.verify_lens is None else int(result.verify_lens[i])
                    req.record_verify(verified, int(result.accept_lens[i]))
                before = len(req.output_ids)
                req.append_tokens(result.new_tokens(i), self.eos_token_ids)
                self.stats["generated_tokens"] += len(req.output_ids) - before
            except Exception as e:
                logger.exception("post-processing failed for request %s", req.rid)
                req.abort(f"internal error while processing output: {type(e).__name__}: {e}")

    def score(self, token_ids: list[int], top_k: int) -> TokenScores | None:
        """Logprobs of a sequence from the worker (see `TargetWorker.score`); None while the KV
        pool lacks the pages."""
        with self._lock:
            return self.worker.score(token_ids, top_k)

    def _finish(self, req: Req) -> None:
        if req in self.running:
            self._release(req)
            self.running.remove(req)
        self.stats["num_finished"] += 1
        if req.spec_verify_ct:
            self.stats["spec_completion_tokens"] += len(req.output_ids)
            self.stats["spec_verify_ct"] += req.spec_verify_ct
            self.stats["spec_num_proposed_drafts"] += req.spec_num_proposed_drafts
            self.stats["spec_num_correct_drafts"] += req.spec_num_correct_drafts
            self.stats["spec_no_spec_steps"] += req.spec_no_spec_steps

    def _release(self, req: Req) -> None:
        if req.slot is not None:
            self.allocator.free(req.slot)
            self.worker.release(req.slot)
            self._free_slots.append(req.slot)
            req.slot = None

    def _all_requests(self) -> list[Req]:
        return list(self.waiting) + self.running

    # -- introspection --------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """No prefix cache is kept, so there is nothing to drop; like SGLang, only when idle."""
        with self._lock:
            return not (self.waiting or self.running)

    def freeze_gc(self) -> int:
        """SGLang's /freeze_gc: every object alive now leaves the collector's reach (gc_control)."""
        return gc_control.freeze("freeze_gc")

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            s = self.stats
            stats = {
                "num_running": len(self.running),
                "num_waiting": len(self.waiting),
                "num_free_pages": self.allocator.num_free_pages,
                "total_pages": self.total_pages,
                "token_usage": 1.0 - self.allocator.num_free_pages / self.total_pages,
                "num_requests": s["num_requests"],
                "num_finished": s["num_finished"],
                "num_retractions": s["num_retractions"],
                "prompt_tokens": s["prompt_tokens"],
                "generated_tokens": s["generated_tokens"],
                "decode_steps": s["decode_steps"],
                "speculative_algorithm": self.algorithm.name,
                "avg_spec_accept_length": (
                    s["spec_completion_tokens"] / s["spec_verify_ct"] if s["spec_verify_ct"] else None
                ),
                "spec_accept_rate": (
                    s["spec_num_correct_drafts"] / s["spec_num_proposed_drafts"]
                    if s["spec_num_proposed_drafts"] else None
                ),
                # Chosen verify lengths (drafts per decode step; differ from the block with
                # --speculative-adaptive), over finished requests.
                "spec_mean_verify_len": (
                    s["spec_num_proposed_drafts"] / s["spec_verify_ct"] if s["spec_verify_ct"] else None
                ),
                "spec_no_spec_fraction": s["spec_no_spec_steps"] / s["spec_verify_ct"] if s["spec_verify_ct"] else None,
                "timestamp": time.time(),
            }
            return stats
