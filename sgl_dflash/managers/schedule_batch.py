"""Requests and batches, with SGLang's names: `Req` is one request's state (only the scheduler
changes it); `ScheduleBatch` is the requests one step runs, which it describes to the worker as a
plain-data `ModelWorkerBatch` (model_executor/forward_batch_info.py: the seam).

Finish reasons use SGLang's JSON form: {"type": "length", "length": n},
{"type": "stop", "matched": token_id_or_string}, {"type": "abort", "message": ...}.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from sgl_dflash.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch, SamplingBatchInfo
from sgl_dflash.sampling_params import SamplingParams

_rid_counter = itertools.count()


def new_rid() -> str:
    return f"req-{next(_rid_counter)}"


@dataclasses.dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    # Matches stop strings on the output's text, decoded incrementally (an
    # IncrementalDetokenizer; set by the scheduler when the request has stop strings).
    stop_detokenizer: Any = None
    created_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_retractions: int = 0
    # KV-allocator / drafter sequence id while running (set by the scheduler).
    slot: int | None = None
    # Speculative decoding counters (DFLASH).
    spec_verify_ct: int = 0
    spec_num_proposed_drafts: int = 0
    spec_num_correct_drafts: int = 0
    spec_correct_drafts_histogram: list[int] = dataclasses.field(default_factory=list)
    # Drafts sent to verification per decode step: [k] = steps that verified k (adaptive mode
    # chooses k per step; 0 = a step without speculation).
    spec_verify_len_histogram: list[int] = dataclasses.field(default_factory=list)
    # Target aux-layer rows of every token fed so far (ServerArgs.aux_hidden_layers), in chunks.
    aux_hidden: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def committed_len(self) -> int:
        """Tokens whose target K/V is cached: all but the last (pending) token."""
        return len(self.input_ids) + len(self.output_ids) - 1

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    # -- finishing ------------------------------------------------------------------------
    def finish(self, reason: dict[str, Any]) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
            self.finished_time = time.perf_counter()

    def abort(self, message: str, status_code: int = 500) -> None:
        self.finish({"type": "abort", "message": message, "status_code": status_code})

    def append_tokens(self, tokens: Iterable[int], eos_token_ids: frozenset[int] = frozenset()) -> int:
        """Append newly decided tokens, stopping at the first one that finishes the request.

        Returns how many were kept; the rest (e.g. the tail of a verified block after a stop
        token) are dropped. Checks in SGLang's order: max_new_tokens, then stop tokens, then stop
        strings. `ignore_eos` ignores EOS only; explicit `stop_token_ids` always apply.
        """
        params = self.sampling_params
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= eos_token_ids
        stop_strs = params.stop_strs if self.stop_detokenizer is not None else []
        kept = 0
        for token in tokens:
            if self.finished:
                break
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            self.output_ids.append(int(token))
            kept += 1
            if len(self.output_ids) >= params.max_new_tokens:
                self.finish({"type": "length", "length": params.max_new_tokens})
            elif token in stop_ids:
                self.finish({"type": "stop", "matched": int(token)})
            elif stop_strs:  # after every token: a stop string may end at any of them
                stop = self.stop_detokenizer.find_stop(self.output_ids, stop_strs)
                if stop is not None:
                    self.finish({"type": "stop", "matched": stop})
        return kept

    # -- statistics -----------------------------------------------------------------------
    def init_spec_stats(self, num_drafts: int) -> None:
        """num_drafts: the most drafts one step can verify (block size - 1)."""
        if len(self.spec_correct_drafts_histogram) < num_drafts + 1:
            self.spec_correct_drafts_histogram += [0] * (num_drafts + 1 - len(self.spec_correct_drafts_histogram))
            self.spec_verify_len_histogram += [0] * (num_drafts + 1 - len(self.spec_verify_len_histogram))

    def record_verify(self, num_drafts: int, num_correct: int) -> None:
        """One DFLASH decode step verified `num_drafts` drafts of which `num_correct` were
        accepted (num_drafts 0: an adaptive step without speculation, one token)."""
        self.init_spec_stats(num_drafts)
        self.spec_verify_ct += 1
        self.spec_num_proposed_drafts += num_drafts
        self.spec_num_correct_drafts += num_correct
        self.spec_correct_drafts_histogram[num_correct] += 1
        self.spec_verify_len_histogram[num_drafts] += 1

    @property
    def spec_no_spec_steps(self) -> int:
        return self.spec_verify_len_histogram[0] if self.spec_verify_len_histogram else 0

    def meta_info(self) -> dict[str, Any]:
        end = self.finished_time if self.finished_time is not None else time.perf_counter()
        completion = len(self.output_ids)
        info: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": completion,
            "cached_tokens": 0,
            "finish_reason": self.finished_reason,
            "e2e_latency": end - self.created_time,
        }
        if self.spec_correct_drafts_histogram:  # set up by a speculative worker
            info.update(
                spec_verify_ct=self.spec_verify_ct,
                spec_accept_length=completion / max(1, self.spec_verify_ct),
                spec_num_proposed_drafts=self.spec_num_proposed_drafts,
                spec_num_correct_drafts=self.spec_num_correct_drafts,
                spec_accept_rate=self.spec_num_correct_drafts / max(1, self.spec_num_proposed_drafts),
                spec_correct_drafts_histogram=list(self.spec_correct_drafts_histogram),
                # The chosen verify lengths (drafts per decode step): their mean, and the
                # fraction of steps that verified none (--speculative-adaptive).
                spec_mean_verify_len=self.spec_num_proposed_drafts / max(1, self.spec_verify_ct),
                spec_no_spec_fraction=self.spec_no_spec_steps / max(1, self.spec_verify_ct),
                spec_verify_len_histogram=list(self.spec_verify_len_histogram),
            )
        if self.aux_hidden:  # one row per token of prompt + output but the last
            info["aux_hidden_states"] = np.concatenate(self.aux_hidden)
        return info

    def to_output(self, text: str | None = None) -> dict[str, Any]:
        """SGLang's generate() result: {"text", "output_ids", "meta_info"} ("text" when given)."""
        out: dict[str, Any] = {"output_ids": list(self.output_ids), "meta_info": self.meta_info()}
        if text is not None:
            out = {"text": text, **out}
        return out


@dataclasses.dataclass
class ScheduleBatch:
    """The requests the scheduler runs in one step and how (SGLang's name)."""

    reqs: list[Req]
    forward_mode: ForwardMode

    def get_model_worker_batch(self, page_table: Callable[[int], list[int]]) -> ModelWorkerBatch:
        extend = self.forward_mode is ForwardMode.EXTEND
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            slots=[r.slot for r in self.reqs],
            # EXTEND computes everything but a pending last output token (a retracted request).
            input_ids=[r.input_ids + r.output_ids[:-1] if extend else [r.last_token] for r in self.reqs],
            prefix_lens=[0 if extend else r.committed_len for r in self.reqs],
            page_tables=[page_table(r.slot) for r in self.reqs],
            sample=[not r.output_ids for r in self.reqs] if extend else [True] * len(self.reqs),
            sampling_info=SamplingBatchInfo.from_params([r.sampling_params for r in self.reqs]),
        )
