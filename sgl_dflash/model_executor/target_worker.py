"""TargetWorker: the target model behind the worker interface (SGLang's TpModelWorker); it is
also the NONE algorithm's worker (plain autoregressive decoding).

`forward_batch_generation(ModelWorkerBatch) -> GenerationBatchResult` runs ONE packed ragged
target step for the batch (a decode samples inside it: `TargetRunner.sample`, only token ids come
back) and returns a token per request; it never touches a request.
The KV pages belong to jax_backend's allocator (`self.allocator`): the scheduler allocates and
frees a request's pages there and hands the worker page tables; logprob scoring (`score`) takes
pages of its own there for one forward and gives them back.

Workers take `server_args` untyped and read fields by SGLang's names (model_path, page_size,
max_total_tokens, ...), so that they import nothing from the modules that create them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_backend import ForwardOutput, SeqInput, TargetRunner, sampling
from jax_backend.batch import bucket
from sgl_dflash.model_executor.forward_batch_info import (
    ForwardMode,
    GenerationBatchResult,
    ModelWorkerBatch,
    SamplingBatchInfo,
    TokenScores,
)

# Sequence id of the pages a logprob scoring forward takes (never a scheduler slot: those are ints).
SCORING_SEQ_ID = "logprob-scoring"


class TargetWorker:
    def __init__(self, server_args: Any, aux_layer_ids: Sequence[int] = (), tokens_per_step: int = 1):
        self.server_args = server_args
        # KV slots one decode step writes past the committed length (a DFLASH block writes B).
        self.tokens_per_step = tokens_per_step
        # Recording aux rows for the caller (training data) is a NONE feature (ServerArgs.check).
        self.record_aux = bool(getattr(server_args, "aux_hidden_layers", None))
        if self.record_aux:
            aux_layer_ids = server_args.aux_hidden_layers
        self.runner = TargetRunner(
            server_args.model_path,
            dtype=server_args.resolved_dtype,
            page_size=server_args.page_size,
            max_total_tokens=server_args.max_total_tokens,
            max_num_seqs=server_args.max_running_requests,
            max_model_len=server_args.context_length + tokens_per_step,
            aux_layer_ids=aux_layer_ids,
            tp_size=getattr(server_args, "tp_size", 1),
            layer_loop=getattr(server_args, "layer_loop", "auto"),  # SGLang's ServerArgs have none
        )
        self.allocator = self.runner.allocator
        self.vocab_size = self.runner.config.vocab_size
        self._key = jax.random.PRNGKey(server_args.random_seed)

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        if batch.forward_mode is ForwardMode.EXTEND:
            return self.forward_extend(batch)[0]
        return self.forward_decode(batch)

    def forward_extend(self, batch: ModelWorkerBatch, features: bool = True) -> tuple[GenerationBatchResult, ForwardOutput]:
        """The K/V of each request's committed tokens, and a first token for the new ones (also
        returns the forward's output, whose aux rows the DFLASH worker hands its drafter). A
        request's tokens run after its prefix_len cached ones (a prefill chunk after the first).
        `features=False`: no aux rows (an adaptive worker's prefill where none gets drafter context)."""
        out = self.runner.forward([
            SeqInput(ids, prefix, table, "last")
            for ids, prefix, table in zip(batch.input_ids, batch.prefix_lens, batch.page_tables)
        ], features=features)
        n = len(batch.slots)
        tokens, counts = np.zeros((n, 1), np.int32), np.zeros(n, np.int32)
        fresh = [i for i in range(n) if batch.sample[i]]
        if fresh:
            logits = np.concatenate([out.logits[i] for i in fresh])
            tokens[fresh, 0] = self.sample(logits, batch.sampling_info.select(fresh))
            counts[fresh] = 1
        return GenerationBatchResult(tokens, counts, aux_hidden_states=self._aux_rows(out)), out

    def forward_decode(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        """One token per request: its pending token runs at position prefix_len, and the token is
        sampled inside the same jitted step (only the ids come to the host)."""
        info = batch.sampling_info
        out = self.runner.sample([
            SeqInput(ids, start, table, "last")
            for ids, start, table in zip(batch.input_ids, batch.prefix_lens, batch.page_tables)
        ], info.temperatures, info.top_ps, info.top_ks, None if info.is_all_greedy else self.next_key(),
            features=self.record_aux)  # (an adaptive worker's steps without drafter context read none)
        tokens = out.tokens
        n = len(batch.slots)
        return GenerationBatchResult(tokens.reshape(n, 1), np.ones(n, np.int32),
                                     aux_hidden_states=self._aux_rows(out))

    def release(self, slot: int) -> None:
        """Nothing per sequence but its pages, which the scheduler frees."""

    def num_compilations(self) -> int:
        return self.runner.num_compilations()

    # -- sampling -------------------------------------------------------------------------
    def next_key(self) -> jax.Array:
        self._key, key = jax.random.split(self._key)
        return key

    def sample(self, logits: np.ndarray, sampling_info: SamplingBatchInfo) -> np.ndarray:
        """One token per row of `logits` [n, V] with each request's sampling settings."""
        n = logits.shape[0]
        rows = bucket(n)  # few distinct shapes: no recompiling as the batch changes
        padded = np.zeros((rows, logits.shape[-1]), np.float32)
        padded[:n] = logits
        temperature, top_p, top_k = sampling_info.padded(rows)
        tokens = sampling.sample(padded, temperature, top_p, top_k, self.next_key())
        return np.asarray(tokens)[:n]

    def _aux_rows(self, out: ForwardOutput) -> list[np.ndarray] | None:
        if not self.record_aux:
            return None
        return list(out.features)

    # -- logprob scoring ------------------------------------------------------------------
    def score(self, token_ids: list[int], top_k: int) -> TokenScores | None:
        """The target's logprob of each of token_ids[1:] and its top-k alternatives (one forward,
        every position's logits). None when the KV pool lacks the pages right now: call again
        after the scheduler's next step."""
        n = len(token_ids)
        if n < 2:
            empty = np.zeros((0, 0))
            return TokenScores(np.zeros(0), empty.astype(np.int64), empty)
        if self.allocator.pages_needed(SCORING_SEQ_ID, n) > self.allocator.num_free_pages:
            return None
        table = self.allocator.allocate(SCORING_SEQ_ID, n)
        try:
            out = self.runner.forward([SeqInput(list(token_ids), 0, table, "all")])
        finally:
            self.allocator.free(SCORING_SEQ_ID)
        logits = np.asarray(out.logits[0][: n - 1], np.float64)  # row j predicts token j+1
        shifted = logits - logits.max(axis=-1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        token_logprobs = logprobs[np.arange(n - 1), np.asarray(token_ids[1:], np.int64)]
        k = min(max(top_k, 0), logprobs.shape[-1])
        top_ids = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
        return TokenScores(token_logprobs, top_ids, np.take_along_axis(logprobs, top_ids, axis=-1))
