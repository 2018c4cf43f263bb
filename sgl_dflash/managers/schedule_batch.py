"""Requests and batches, with SGLang's names, and the seam between the scheduler and a worker:

    Scheduler ── ModelWorkerBatch ──► worker.forward_batch_generation ── GenerationBatchResult ──► Scheduler
                 (what to run: plain data)                                (what it produced: ids, counts)

`Req` is one request's state; only the scheduler changes it. A worker sees a `ModelWorkerBatch`
(slots, token ids, positions, page tables, sampling settings) and returns token ids per request,
accept counts and aux rows; the scheduler applies them (`Scheduler.process_batch_result`, as
SGLang's scheduler does with a `GenerationBatchResult` and nano-vllm's `postprocess`). Results are
arrays a jitted step can fill on device: only ids and counts need to cross to the host.

Finish reasons use SGLang's JSON form: {"type": "length", "length": n},
{"type": "stop", "matched": token_id_or_string}, {"type": "abort", "message": ...}.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

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
        if len(self.spec_correct_drafts_histogram) != num_drafts + 1:
            self.spec_correct_drafts_histogram = [0] * (num_drafts + 1)

    def record_verify(self, num_drafts: int, num_correct: int) -> None:
        """One DFLASH verify step proposed `num_drafts` drafts of which `num_correct` were accepted."""
        self.init_spec_stats(num_drafts)
        self.spec_verify_ct += 1
        self.spec_num_proposed_drafts += num_drafts
        self.spec_num_correct_drafts += num_correct
        self.spec_correct_drafts_histogram[num_correct] += 1

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


# -- the seam: scheduler -> worker -> scheduler ----------------------------------------------
class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: compute the K/V of committed tokens, sample a first token
    DECODE = "decode"  # one step for every running request (1 token, or a DFLASH block)


@dataclasses.dataclass(frozen=True)
class SamplingBatchInfo:
    """Per-request sampling settings as arrays. Greedy requests have temperature 0."""

    temperatures: np.ndarray  # f32 [n]
    top_ps: np.ndarray  # f32 [n]
    top_ks: np.ndarray  # i32 [n]; 0 = the whole vocabulary

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> "SamplingBatchInfo":
        return cls(
            np.array([0.0 if p.is_greedy else p.temperature for p in params], np.float32),
            np.array([p.top_p for p in params], np.float32),
            np.array([max(p.top_k, 0) for p in params], np.int32),
        )

    @property
    def is_all_greedy(self) -> bool:
        return not np.any(self.temperatures > 0)

    def select(self, rows: Sequence[int]) -> "SamplingBatchInfo":
        rows = list(rows)
        return SamplingBatchInfo(self.temperatures[rows], self.top_ps[rows], self.top_ks[rows])

    def padded(self, rows: int, repeat: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(temperature, top_p, top_k) with each request repeated `repeat` times, padded (greedy)
        to `rows` rows: few distinct shapes, so the jitted sampling does not recompile."""
        n = len(self.temperatures) * repeat
        temperature, top_p, top_k = np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32)
        temperature[:n] = np.repeat(self.temperatures, repeat)
        top_p[:n] = np.repeat(self.top_ps, repeat)
        top_k[:n] = np.repeat(self.top_ks, repeat)
        return temperature, top_p, top_k


@dataclasses.dataclass(frozen=True)
class ModelWorkerBatch:
    """What a worker runs for one step: row i is one request (SGLang's name)."""

    forward_mode: ForwardMode
    slots: list[int]  # sequence ids in the page allocator and the drafter
    input_ids: list[list[int]]  # tokens to run: EXTEND the committed ones, DECODE [pending token]
    prefix_lens: list[int]  # tokens already in the KV cache (their positions come first)
    page_tables: list[list[int]]  # pages covering prefix + this step's tokens
    # EXTEND: False for a retracted request being recomputed (its last token stays pending).
    sample: list[bool]
    sampling_info: SamplingBatchInfo


@dataclasses.dataclass
class GenerationBatchResult:
    """What a worker produced for one step (SGLang's name); row i is `ModelWorkerBatch` row i."""

    next_token_ids: np.ndarray  # i32 [n, W]: row i's new tokens are its first num_new_tokens[i]
    num_new_tokens: np.ndarray  # i32 [n]
    accept_lens: np.ndarray | None = None  # i32 [n]: drafts accepted (speculative decode steps)
    num_draft_tokens: int = 0  # drafts proposed per request per verify step (speculative)
    aux_hidden_states: list[np.ndarray] | None = None  # rows per request (ServerArgs.aux_hidden_layers)

    def new_tokens(self, i: int) -> list[int]:
        return self.next_token_ids[i, : int(self.num_new_tokens[i])].tolist()


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


@dataclasses.dataclass
class TokenScores:
    """A worker's scores of tokens[1:] of a sequence: logprob of each and the top-k alternatives."""

    token_logprobs: np.ndarray  # [n-1] float64
    top_ids: np.ndarray  # [n-1, k] int
    top_logprobs: np.ndarray  # [n-1, k] float64
