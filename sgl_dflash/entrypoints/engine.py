"""Offline engine shaped like `sglang.Engine`: `Engine(**server_args).generate(...)`."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from sgl_dflash.errors import InvalidRequestError, ServerArgsError
from sgl_dflash.managers.detokenizer_manager import final_text
from sgl_dflash.managers.schedule_batch import Req, new_rid
from sgl_dflash.managers.scheduler import Scheduler
from sgl_dflash.sampling_params import SamplingParams
from sgl_dflash.server_args import ServerArgs


class Engine:
    """In-process generation: every prompt of a call is queued at once and decoded in one batch.
    `tp_size=N` shards the target over N devices; with `nnodes`, `node_rank` and `dist_init_addr`
    over the devices of several hosts, each running the same calls (docs/scale.md)."""

    def __init__(self, **kwargs: Any):
        self.server_args = ServerArgs(**kwargs)
        if self.server_args.dp_size != 1:
            # One engine is one process; SGLang's dp_size starts replicas, which here are servers.
            raise ServerArgsError(
                f"dp_size={self.server_args.dp_size}: data parallel runs replicas behind sglang-router; "
                "use `python -m sgl_dflash.launch_server --dp-size N` (docs/scale.md)"
            )
        self.server_args.check_distributed()
        if self.server_args.nnodes > 1:  # before anything starts a JAX backend
            import jax

            if not jax.distributed.is_initialized():  # once per process (several engines may follow)
                jax.distributed.initialize(self.server_args.dist_init_addr, num_processes=self.server_args.nnodes,
                                           process_id=self.server_args.node_rank)
        self.scheduler = Scheduler(self.server_args)
        self.tokenizer = self.scheduler.tokenizer

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list).

        Each result is `{"text", "output_ids", "meta_info"}` (no "text" with
        skip_tokenizer_init). `sampling_params` is one dict for all prompts or one per prompt.
        """
        single, token_lists = self._inputs(prompt, input_ids)
        reqs = self._queue(token_lists, self._sampling_params(sampling_params, len(token_lists)))
        outputs: list[dict[str, Any]] = [{} for _ in reqs]
        for i, out in self._drain(reqs):
            outputs[i] = out
        return outputs[0] if single else outputs

    def generate_as_completed(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Like `generate` for a list of prompts, but yields `(index, result)` as each request
        finishes, so a long job (regenerating a data set) keeps the batch full and saves as it goes.
        Every prompt is validated and queued before this returns (admitted in order); closing the
        iterator early aborts the requests still running or waiting."""
        _, token_lists = self._inputs(prompt, input_ids)
        return self._drain(self._queue(token_lists, self._sampling_params(sampling_params, len(token_lists))))

    def _queue(self, token_lists: list[list[int]], params: list[SamplingParams]) -> list[Req]:
        reqs = [Req(new_rid(), ids, sp) for ids, sp in zip(token_lists, params)]
        for req in reqs:  # validate all before queueing any
            self.scheduler.validate_request(req)
        try:
            for req in reqs:
                self.scheduler.add_request(req)
        except BaseException:
            self._abort_unfinished(reqs)
            raise
        return reqs

    def _drain(self, reqs: list[Req]) -> Iterator[tuple[int, dict[str, Any]]]:
        left = list(range(len(reqs)))
        try:
            while left:
                self.scheduler.step()
                done = [i for i in left if reqs[i].finished]
                if done:
                    left = [i for i in left if not reqs[i].finished]
                for i in done:
                    # Text is decoded once per request, after the scheduler is done with it.
                    req = reqs[i]
                    text = None if self.tokenizer is None else final_text(self.tokenizer, req.output_ids,
                                                                          req.finished_reason)
                    yield i, req.to_output(text)
        finally:  # an error, or a caller that stopped iterating: nothing stays queued
            self._abort_unfinished(reqs)

    def _abort_unfinished(self, reqs: list[Req]) -> None:
        for req in reqs:
            if not req.finished:
                self.scheduler.abort_request(req.rid)

    def _inputs(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("pass exactly one of `prompt` and `input_ids`")
        if input_ids is not None:
            if not isinstance(input_ids, list) or not input_ids:
                raise InvalidRequestError("input_ids must be a non-empty list of token ids (or of lists)")
            single = not isinstance(input_ids[0], list)
            return single, [list(input_ids)] if single else [list(ids) for ids in input_ids]
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer: pass input_ids with skip_tokenizer_init=True")
        single = isinstance(prompt, str)
        prompts = [prompt] if single else prompt
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise InvalidRequestError("prompt must be a string or a list of strings")
        return single, [self.tokenizer.encode(p) for p in prompts]

    @staticmethod
    def _sampling_params(params: Any, n: int) -> list[SamplingParams]:
        if isinstance(params, list):
            if len(params) != n:
                raise InvalidRequestError(f"got {len(params)} sampling_params for {n} prompts")
            return [SamplingParams.from_dict(p) for p in params]
        # One object per request: admission may clip max_new_tokens per prompt.
        return [dataclasses.replace(SamplingParams.from_dict(params)) for _ in range(n)]

    def get_server_info(self) -> dict[str, Any]:
        return {**vars(self.server_args), "internal_states": [self.scheduler.get_stats()]}

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def freeze_gc(self) -> int:
        """Moves every Python object alive now out of the garbage collector's full passes (SGLang's
        freeze_gc). An in-process Engine does not freeze by default (a server does, unless
        `disable_gc_freeze`; docs/server.md). Returns the number of frozen objects."""
        return self.scheduler.freeze_gc()

    def shutdown(self) -> None:
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            self.scheduler.abort_request(req.rid)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
