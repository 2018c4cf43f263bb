"""TokenizerManager: the bridge between asyncio HTTP handlers and the blocking `Scheduler`.

One background thread owns the scheduler: it takes commands (add, abort, flush...) from a
thread-safe inbox, runs `scheduler.step()` while there is work, and hands a snapshot of every
request that progressed to the event loop, which routes it to the request's asyncio queue.
Handlers never call into the scheduler directly, so a long model step never blocks the event
loop, and the scheduler's state is only touched by its own thread.

Snapshots carry token ids; text is made here, on the event-loop side, never in the scheduler
thread (`detokenizer_manager`): each streamed chunk carries the text decoded so far (incrementally:
only the new tokens are decoded) minus a held-back tail (an incomplete UTF-8 character, or the
beginning of a stop string that may still be trimmed), so what was sent is always a prefix of the
final text; a finished request's text is decoded once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sgl_dflash.errors import GenerationError, InvalidRequestError
from sgl_dflash.managers.detokenizer_manager import REPLACEMENT_CHAR, IncrementalDetokenizer, final_text
from sgl_dflash.managers.io_struct import GenerateRequest, Snapshot
from sgl_dflash.managers.logprobs import logprob_meta_info
from sgl_dflash.managers.metrics import ServerMetrics
from sgl_dflash.managers.schedule_batch import Req
from sgl_dflash.managers.scheduler import Scheduler
from sgl_dflash.model_executor.forward_batch_info import TokenScores
from sgl_dflash.server_args import ServerArgs

logger = logging.getLogger(__name__)


class _ReqState:
    def __init__(self, request: GenerateRequest, req: Req):
        self.request = request
        self.req = req
        self.queue: asyncio.Queue[Snapshot] = asyncio.Queue()
        self.sent_text = ""
        self.detokenizer: IncrementalDetokenizer | None = None  # made on the first streamed chunk
        self.arrival = time.perf_counter()
        self.first_output_time: float | None = None
        self.done = False


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, scheduler: Scheduler | None = None):
        self.scheduler = scheduler if scheduler is not None else Scheduler(server_args)
        self.server_args = self.scheduler.server_args
        self.tokenizer = self.scheduler.tokenizer
        self.model_path = self.server_args.model_path
        self.served_model_name = self.server_args.served_model_name or self.model_path
        self.metrics = ServerMetrics(self.served_model_name)
        self.latest_stats: dict[str, Any] = self.scheduler.get_stats()
        if not self.server_args.disable_gc_freeze:  # a server's startup objects live as long as it does
            self.scheduler.freeze_gc()
        self.startup_time = time.time()

        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._deferred: list[Callable[[], None]] = []  # jobs waiting for KV pages (scheduler thread)
        self._wakeup = threading.Event()
        self._states: dict[str, _ReqState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread; call from inside the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._scheduler_loop, name="scheduler", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- scheduler thread -----------------------------------------------------------------
    def _scheduler_loop(self) -> None:
        while not self._stopping:
            try:
                self._run_once()
            except Exception:  # never let the thread die: later requests must still be served
                logger.exception("scheduler loop iteration failed")

    def _run_once(self) -> None:
        self._wakeup.clear()
        while self._inbox:
            job = self._inbox.popleft()
            try:
                job()
            except Exception:
                logger.exception("scheduler command failed")
        if not self.scheduler.has_work():
            self._refresh_stats()
            self._wakeup.wait(timeout=1.0)
            return
        try:
            progressed = self.scheduler.step()
        except Exception as e:  # the scheduler isolates request failures; this is a last resort
            logger.exception("scheduler step failed")
            progressed = self._abort_all(f"internal error: {type(e).__name__}: {e}")
        snapshots = [self._snapshot(req) for req in progressed]
        self._inbox.extend(self._deferred)
        self._deferred.clear()
        self._refresh_stats()
        if snapshots:
            self._loop.call_soon_threadsafe(self._deliver, snapshots)

    def _abort_all(self, message: str) -> list[Req]:
        reqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        for req in reqs:
            try:
                self.scheduler.abort_request(req.rid)
            except Exception:
                logger.exception("abort of %s failed", req.rid)
            req.finish({"type": "abort", "message": message, "status_code": 500})
        return reqs

    def _refresh_stats(self) -> None:
        try:
            self.latest_stats = self.scheduler.get_stats()
        except Exception:
            logger.exception("scheduler.get_stats failed")

    @staticmethod
    def _snapshot(req: Req) -> Snapshot:
        meta_info = req.meta_info()
        meta_info["num_retractions"] = req.num_retractions
        reason = req.finished_reason
        return Snapshot(
            rid=req.rid,
            output_ids=list(req.output_ids),
            finished_reason=dict(reason) if reason is not None else None,
            meta_info=meta_info,
        )

    def _post(self, fn: Callable[[], None]) -> None:
        self._inbox.append(fn)
        self._wakeup.set()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """Run `fn(*args)` in the scheduler thread between steps; await its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the awaiting handler
                future.set_exception(e)

        self._post(run)
        return asyncio.wrap_future(future)

    async def _score(self, token_ids: list[int], top_k: int) -> TokenScores:
        """Score a sequence with the target in the scheduler thread, waiting for KV pages."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def attempt() -> None:
            try:
                scores = self.scheduler.score(token_ids, top_k)
                if scores is None and not self.scheduler.has_work():
                    raise GenerationError(f"the KV pool cannot hold {len(token_ids)} tokens for scoring")
            except BaseException as e:
                future.set_exception(e)
                return
            if scores is None:
                self._deferred.append(attempt)  # retried after the next step frees pages
            else:
                future.set_result(scores)

        self._post(attempt)
        return await asyncio.wrap_future(future)

    # -- event loop side ------------------------------------------------------------------
    def _deliver(self, snapshots: list[Snapshot]) -> None:
        for snap in snapshots:
            state = self._states.get(snap.rid)
            if state is not None:
                state.queue.put_nowait(snap)

    def tokenize(self, request: GenerateRequest) -> list[int]:
        if request.input_ids is not None:
            return request.input_ids
        if self.tokenizer is None:
            raise InvalidRequestError("this server runs with --skip-tokenizer-init: send input_ids, not text",
                                      param="text")
        if request.text == "":
            raise InvalidRequestError("the prompt is empty (text is an empty string)", param="text")
        try:
            return self.tokenizer.encode(request.text)
        except Exception as e:  # e.g. text the tokenizer's normalizer refuses
            raise InvalidRequestError(f"the text could not be tokenized: {type(e).__name__}: {e}",
                                      param="text") from None

    def prepare(self, request: GenerateRequest, input_ids: list[int] | None = None) -> Req:
        """Tokenize and validate one request (no scheduling yet); raises `InvalidRequestError`
        naming the field. Lengths follow SGLang (`TokenizerManager._validate_one_request`)."""
        if request.rid in self._states:
            raise InvalidRequestError(f"request id {request.rid!r} is already in use", param="rid")
        ids = list(input_ids if input_ids is not None else self.tokenize(request))
        vocab = self.scheduler.worker.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"input_ids contain invalid token ids {bad[:5]} (vocab size {vocab})",
                                      param="input_ids")
        ids = self._check_context_length(request, ids)
        if request.return_logprob:
            start, top = request.logprob_start_len, request.top_logprobs_num
            if isinstance(start, bool) or not isinstance(start, int) or not -1 <= start <= len(ids):
                raise InvalidRequestError(
                    f"logprob_start_len must be -1 or in [0, {len(ids)}] (the number of input "
                    f"tokens), got {start!r}", param="logprob_start_len"
                )
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= vocab:
                raise InvalidRequestError(f"top_logprobs_num must be an integer in [0, {vocab}] (the "
                                          f"vocabulary size), got {top!r}", param="top_logprobs_num")
        req = Req(request.rid, ids, request.sampling_params)
        self.scheduler.validate_request(req)  # pure checks; safe from this thread
        return req

    def _check_context_length(self, request: GenerateRequest, ids: list[int]) -> list[int]:
        """SGLang's rule: a prompt must leave room in the context, and prompt + max_new_tokens
        (when the client chose it) must fit; with --allow-auto-truncate the prompt is cut (its
        beginning kept) and max_new_tokens clipped instead. Returns the ids to run."""
        limit = self.scheduler.max_req_len  # the context length, or the KV pool if smaller
        truncate = self.server_args.allow_auto_truncate
        if ids and len(ids) >= limit:
            if not truncate:
                raise InvalidRequestError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({limit} tokens).", param="input_ids" if request.text is None else "text",
                    code="context_length_exceeded")
            logger.warning("request %s: input of %d tokens truncated to %d", request.rid, len(ids), limit - 1)
            ids = ids[: limit - 1]  # one position left for the first output token
        max_new = request.sampling_params.max_new_tokens
        if request.max_new_tokens_explicit and isinstance(max_new, int) and len(ids) + max_new > limit:
            if not truncate:
                raise InvalidRequestError(
                    f"Requested token count exceeds the model's maximum context length of {limit} "
                    f"tokens. You requested a total of {len(ids) + max_new} tokens: {len(ids)} tokens "
                    f"from the input messages and {max_new} tokens for the completion. Please reduce "
                    "the number of tokens in the input messages or the completion to fit within the "
                    "limit.", param="sampling_params.max_new_tokens", code="context_length_exceeded")
            request.sampling_params.max_new_tokens = limit - len(ids)
        return ids

    async def generate(
        self,
        request: GenerateRequest,
        req: Req,
    ) -> AsyncIterator[dict[str, Any]]:
        """Run one prepared request; yields cumulative outputs (every step when streaming, else
        only the final one) shaped like SGLang's: {"text", "output_ids", "meta_info"}.

        Cancelling the caller's task (a client that went away, a timeout) aborts the request:
        that lands in the `finally` below.
        """
        if req.rid in self._states:
            raise InvalidRequestError(f"request id {req.rid!r} is already in use")
        state = _ReqState(request, req)
        self._states[req.rid] = state
        try:
            try:
                await self._call(self.scheduler.add_request, req)
            except InvalidRequestError:
                state.done = True  # never queued
                raise
            while True:
                snap = await self._next_snapshot(state)
                finished = snap.finished_reason is not None
                if state.first_output_time is None and snap.output_ids:
                    state.first_output_time = time.perf_counter()
                if finished:
                    state.done = True  # the scheduler is done with it: nothing left to abort
                    reason = snap.finished_reason
                    if reason.get("type") != "abort" and request.return_logprob:
                        await self._add_logprobs(state, snap)
                    self._on_finish(state, snap)
                    if reason.get("type") == "abort":
                        raise GenerationError(
                            reason.get("message", "aborted"), reason.get("status_code", 500)
                        )
                    yield self._output(state, snap)
                    return
                if request.stream:
                    yield self._output(state, snap)
        finally:
            if not state.done:
                self._post(lambda rid=req.rid: self.scheduler.abort_request(rid))
                self.metrics.num_aborted_requests.inc()
            self._states.pop(req.rid, None)

    async def _next_snapshot(self, state: _ReqState) -> Snapshot:
        """The latest snapshot (intermediate ones are cumulative, so they may be skipped)."""
        snap = await state.queue.get()
        while not state.queue.empty() and snap.finished_reason is None:
            snap = state.queue.get_nowait()
        return snap

    async def _add_logprobs(self, state: _ReqState, snap: Snapshot) -> None:
        request, input_ids = state.request, state.req.input_ids
        scores = await self._score(input_ids + snap.output_ids, request.top_logprobs_num)
        decode_token = None
        if request.return_text_in_logprobs and self.tokenizer is not None:
            decode_token = lambda t: self.tokenizer.decode([t])  # noqa: E731
        snap.meta_info.update(logprob_meta_info(
            scores, input_ids, snap.output_ids, logprob_start_len=request.logprob_start_len,
            top_logprobs_num=request.top_logprobs_num, decode_token=decode_token,
        ))

    def _output(self, state: _ReqState, snap: Snapshot) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tokenizer is not None:
            out["text"] = self._text(state, snap)
        out["output_ids"] = snap.output_ids
        out["meta_info"] = snap.meta_info
        return out

    def _text(self, state: _ReqState, snap: Snapshot) -> str:
        """Text safe to show now: never retracted later (see module docstring)."""
        if snap.finished_reason is not None:
            return final_text(self.tokenizer, snap.output_ids, snap.finished_reason)
        if state.detokenizer is None:
            state.detokenizer = IncrementalDetokenizer(self.tokenizer)
        text = state.detokenizer.update(snap.output_ids)
        end = len(text.rstrip(REPLACEMENT_CHAR))
        hold = 0
        for stop in state.req.sampling_params.stop_strs:
            for k in range(min(len(stop) - 1, end), hold, -1):
                if text.endswith(stop[:k], 0, end):
                    hold = k
                    break
        visible = text[: end - hold]
        if visible.startswith(state.sent_text):
            state.sent_text = visible
        return state.sent_text

    def _on_finish(self, state: _ReqState, snap: Snapshot) -> None:
        now = time.perf_counter()
        meta = snap.meta_info
        meta["e2e_latency"] = now - state.arrival
        reason = snap.finished_reason or {}
        aborted = reason.get("type") == "abort"
        self.metrics.on_request_finished(
            prompt_tokens=meta.get("prompt_tokens", 0),
            completion_tokens=meta.get("completion_tokens", 0),
            e2e_latency=now - state.arrival,
            ttft=(state.first_output_time or now) - state.arrival,
            is_stream=state.request.stream,
            aborted=aborted,
        )

    # -- control --------------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        """Abort request `rid` (its handler ends with a 499 error); unknown ids are ignored."""
        self._post(lambda: self.scheduler.abort_request(rid))

    async def flush_cache(self) -> bool:
        return await self._call(self.scheduler.flush_cache)

    async def freeze_gc(self) -> int:
        return await self._call(self.scheduler.freeze_gc)

    def get_internal_state(self) -> dict[str, Any]:
        return dict(self.latest_stats)

    def num_pending(self) -> int:
        return len(self._states)
