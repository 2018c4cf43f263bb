"""The drafter's jitted programs, built once per drafter structure and block size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch

from .config import DFlashConfig
from .dflash2 import build_draft_model
from .dflash2_jax import draft_path
from .jax_drafter import draft_block, extend_cache


class JittedDrafter:
    """`draft_block` and `extend_cache` jitted for one drafter structure and block size.

    Built around a weightless (meta-device) module: every weight comes in through the params
    pytree, so one instance serves every proposer whose drafter has the same config (see
    `jitted_drafter`), and compiled programs are shared between them.
    """

    def __init__(self, config: DFlashConfig, block_size: int):
        with torch.device("meta"):
            skeleton = build_draft_model(config)
        self.num_traces = 0
        self.draft = jax.jit(
            self._counted(functools.partial(draft_block, skeleton, block_size)),
            static_argnames=("read_len",),
            donate_argnames=("k_cache", "v_cache"),
        )
        if config.is_dflash2:  # the selector's path instead of the argmax
            self.draft_path = jax.jit(
                self._counted(functools.partial(draft_path, skeleton, block_size)),
                static_argnames=("read_len",),
                donate_argnames=("k_cache", "v_cache"),
            )
        self.extend = jax.jit(
            self._counted(functools.partial(extend_cache, skeleton)), donate_argnames=("k_cache", "v_cache")
        )
        self.pad_rows = jax.jit(self._counted(_pad_rows), static_argnames=("num_rows", "dtype"))
        self.split_rows = jax.jit(self._counted(_split_rows), static_argnames=("num_rows", "dtype"))
        # The adaptive worker's needs: draft confidences, and pending rows kept across plain steps.
        self.max_prob = jax.jit(self._counted(_max_prob))
        self.stack = jax.jit(self._counted(jnp.stack))
        self.append_rows = jax.jit(self._counted(_append_rows))

    def _counted(self, fn):
        # Runs only while jax traces, i.e. once per new input signature = once per compilation.
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self.num_traces += 1
            return fn(*args, **kwargs)

        return traced


@functools.lru_cache(maxsize=16)
def jitted_drafter(config: DFlashConfig, block_size: int) -> JittedDrafter:
    """The shared `JittedDrafter` for a drafter config (DFlashConfig compares structure only)."""
    return JittedDrafter(config, block_size)


def _pad_rows(rows: jax.Array, *, num_rows: int, dtype) -> jax.Array:
    return jnp.zeros((num_rows, rows.shape[1]), dtype).at[: rows.shape[0]].set(rows.astype(dtype))


def _split_rows(block: jax.Array, *, num_rows: int, dtype) -> tuple[jax.Array, ...]:
    """[S, B, F] -> S arrays [num_rows, F] (rows past B zero)."""
    padded = jnp.zeros((block.shape[0], num_rows, block.shape[2]), dtype).at[:, : block.shape[1]].set(block.astype(dtype))
    return tuple(padded)


def _max_prob(logits: jax.Array) -> jax.Array:
    """[n, B-1, V] drafter logits -> [n, B-1]: the probability of the argmax (the greedy draft)."""
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def _append_rows(pending: tuple[jax.Array, ...], features: jax.Array, offsets: jax.Array) -> tuple[jax.Array, ...]:
    """Per sequence s: pending[s] [P, F] with features[s] [B, F] written from row offsets[s] on
    (rows past P are dropped; rows past a sequence's real count are never read)."""
    stacked = jnp.stack(pending)
    rows = offsets[:, None] + jnp.arange(features.shape[1])[None, :]
    seqs = jnp.broadcast_to(jnp.arange(stacked.shape[0])[:, None], rows.shape)
    return tuple(stacked.at[seqs, rows].set(features.astype(stacked.dtype), mode="drop"))
