"""TargetRunner: the target model's params, paged KV pool and one jitted forward."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_backend import model
from jax_backend.batch import BatchError, SeqInput, build_batch
from jax_backend.kv_cache import PageAllocator
from jax_backend.loader import load_target
from jax_backend.paged_attention import DEFAULT_CHUNK_TOKENS


class ContextLengthError(ValueError):
    """A sequence would run past the runner's max_model_len."""


@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    """`logits[i]`: np.float32 [1, V] ("last") or [q_len, V] ("all") for sequence i.
    `aux_hidden[i]`: jax array [q_len, n_aux * H] (outputs of the aux layers, concatenated in
    `aux_layer_ids` order); an empty tuple when the runner has no aux layers."""

    logits: list[np.ndarray]
    aux_hidden: list[jax.Array] | tuple


class TargetRunner:
    """Owns the target params and KV pool; `forward` runs one packed ragged batch.

    Page allocation is the caller's job through `.allocator`. The KV pool holds
    `max_total_tokens` tokens (+ one scratch page); every sequence may span up to
    `max_model_len` tokens (default: min(max_position_embeddings, max_total_tokens)).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "float32",
        page_size: int = 16,
        max_total_tokens: int = 4096,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        aux_layer_ids: Sequence[int] = (),
    ):
        self.config, self.params = load_target(model_dir, dtype)
        config = self.config
        aux_layer_ids = tuple(int(l) for l in aux_layer_ids)
        bad = [l for l in aux_layer_ids if not 0 <= l < config.num_hidden_layers]
        if bad:
            raise ValueError(
                f"aux_layer_ids {bad} out of range for {config.num_hidden_layers} layers"
            )
        if page_size < 1 or max_total_tokens < 1 or max_num_seqs < 1:
            raise ValueError("page_size, max_total_tokens and max_num_seqs must be positive")
        if max_model_len is None:
            max_model_len = min(config.max_position_embeddings, max_total_tokens)
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")

        self.dtype = dtype
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.aux_layer_ids = aux_layer_ids
        self.pages_per_seq = -(-max_model_len // page_size)
        num_pages = -(-max_total_tokens // page_size) + 1  # + scratch page 0
        self.allocator = PageAllocator(num_pages, page_size)
        self.kv_pool = jnp.zeros(
            (
                config.num_hidden_layers,
                num_pages,
                page_size,
                2 * config.num_key_value_heads,
                config.head_dim,
            ),
            self.params["embed"].dtype,
        )

        def step(params, kv_pool, batch):
            return model.forward(params, config, kv_pool, batch, aux_layer_ids)

        self._step = jax.jit(step, donate_argnums=1)

    @property
    def embed(self) -> jax.Array:
        return self.params["embed"]

    @property
    def lm_head(self) -> jax.Array:
        return self.params["lm_head"]

    def hidden_state_features(self, aux: jax.Array) -> jax.Array:
        """Aux rows [q, n_aux*H] of `forward` as transformers' `hidden_states[l + 1]` (z-lab's
        drafter features): each layer's output, except that transformers reports the LAST layer
        after the final norm, so that block (if captured) is normed here."""
        last = self.config.num_hidden_layers - 1
        if last not in self.aux_layer_ids:
            return aux
        block = self.aux_layer_ids.index(last)
        return _norm_block(aux, self.params["norm"], block, self.config.hidden_size, self.config.rms_norm_eps)

    def num_compilations(self) -> int:
        """Number of distinct compiled versions of the jitted forward so far."""
        return self._step._cache_size()

    def forward(self, seqs: Sequence[SeqInput]) -> ForwardOutput:
        """Run prefill chunks, decodes and verify blocks for several sequences in one batch."""
        if len(seqs) > self.max_num_seqs:
            raise BatchError(f"{len(seqs)} sequences exceed max_num_seqs {self.max_num_seqs}")
        vocab = self.config.vocab_size
        for i, seq in enumerate(seqs):
            end = seq.start_pos + len(seq.token_ids)
            if end > self.max_model_len:
                raise ContextLengthError(
                    f"sequence {i}: {end} tokens (start_pos {seq.start_pos} + {len(seq.token_ids)} "
                    f"new) exceed max_model_len {self.max_model_len}"
                )
            ids = np.asarray(seq.token_ids)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise BatchError(f"sequence {i}: token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")

        # min_tokens=2: with a single token row XLA:CPU lowers the KV write to a
        # dynamic-update-slice and copies the whole pool first; one padding row avoids that.
        batch, layout = build_batch(
            seqs, page_size=self.page_size, pages_per_seq=self.pages_per_seq, min_tokens=2,
            min_pages=max(1, DEFAULT_CHUNK_TOKENS // self.page_size),
        )
        logits, aux, self.kv_pool = self._step(self.params, self.kv_pool, batch)

        logits = np.asarray(logits)
        per_seq_logits = [
            logits[start : start + n] for start, n in zip(layout.logit_starts, layout.num_logits)
        ]
        if not self.aux_layer_ids:
            return ForwardOutput(per_seq_logits, ())
        # dynamic_slice: one tiny compiled slice per q_len, not per offset.
        per_seq_aux = [
            jax.lax.dynamic_slice_in_dim(aux, start, q)
            for start, q in zip(layout.token_starts, layout.q_lens)
        ]
        return ForwardOutput(per_seq_logits, per_seq_aux)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _norm_block(aux: jax.Array, weight: jax.Array, block: int, hidden: int, eps: float) -> jax.Array:
    """Apply the final RMSNorm to feature block `block` (columns block*H .. (block+1)*H)."""
    columns = slice(block * hidden, (block + 1) * hidden)
    return aux.at[:, columns].set(model.rms_norm(aux[:, columns], weight, eps))
