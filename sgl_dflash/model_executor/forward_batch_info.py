"""The seam between scheduling and compute (SGLang's names):

    Scheduler ── ModelWorkerBatch ──► worker.forward_batch_generation ── GenerationBatchResult ──► Scheduler
                 (what to run: plain data)                                (what it produced: ids, counts)

A worker sees a `ModelWorkerBatch` (slots, token ids, positions, page tables, sampling settings),
never a request, and returns token ids per request, accept counts and aux rows; the scheduler
alone applies them to its requests (`Scheduler.process_batch_result`, as SGLang's scheduler does
with a `GenerationBatchResult` and nano-vllm's `postprocess`). Results are arrays a jitted step
can fill on device: only ids and counts need to cross to the host.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import numpy as np


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
    def from_params(cls, params: Sequence[Any]) -> "SamplingBatchInfo":
        """From `SamplingParams` objects."""
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
    # i32 [n]: drafts each request sent to verification this step, when it varies per request
    # (--speculative-adaptive; 0 = a plain decode step). None: num_draft_tokens for every request.
    verify_lens: np.ndarray | None = None
    aux_hidden_states: list[np.ndarray] | None = None  # rows per request (ServerArgs.aux_hidden_layers)

    def new_tokens(self, i: int) -> list[int]:
        return self.next_token_ids[i, : int(self.num_new_tokens[i])].tolist()


@dataclasses.dataclass
class TokenScores:
    """A worker's scores of tokens[1:] of a sequence: logprob of each and the top-k alternatives."""

    token_logprobs: np.ndarray  # [n-1] float64
    top_ids: np.ndarray  # [n-1, k] int
    top_logprobs: np.ndarray  # [n-1, k] float64
