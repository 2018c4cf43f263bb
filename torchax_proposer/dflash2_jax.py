"""DFlash 2's draft step lowered to JAX: the drafter pass of `draft_block`, then the selector's path.

`draft_path` is jitted by `jitted.JittedDrafter` (as `.draft_path`) for DFlash 2 configs. The selector's
walk over the B-1 draft positions is a Python loop over a shape, so it unrolls into one fixed
program: no data-dependent loop, nothing read back to the host inside the step.

Sampling: the caller passes per-row temperatures and a PRNG key; the Gumbel noise for the
Gumbel-max draws is made here, inside the jitted step, so a sampled draft costs no extra transfer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from torchax.interop import jax_view, torch_view

from .dflash2 import DFlash2DraftModel
from .cpu_lowering import lowering
from .jax_drafter import Cache, Params, call_model, draft_hidden

SELECTOR = "candidate_selector."


def draft_path(
    model: DFlash2DraftModel,
    block_size: int,
    params: Params,
    embed: jax.Array,
    lm_head: jax.Array,
    k_cache: Cache,
    v_cache: Cache,
    pending: jax.Array,
    new_lens: jax.Array,
    cache_lens: jax.Array,
    slots: jax.Array,
    bonus_tokens: jax.Array,
    token_map: jax.Array | None = None,
    temperatures: jax.Array | None = None,
    key: jax.Array | None = None,
    *,
    read_len: int,
    pending_rows: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None, Cache, Cache]:
    """`draft_block`'s inputs (see there) plus, for sampling, temperatures [n] (0 = greedy row)
    and a PRNG key. Returns (drafts [n, B-1] int32, candidates [n, B-1, K] int32, q [n, B-1, K]
    float32 or None when temperatures is None, k_cache, v_cache)."""
    hidden, k_cache, v_cache = draft_hidden(
        model, block_size, params, embed, k_cache, v_cache, pending, new_lens, cache_lens, slots, bonus_tokens,
        read_len=read_len, pending_rows=pending_rows,
    )
    path, candidates, probs = select_path(
        model, params, hidden[:, 1:], lm_head, bonus_tokens, temperatures=temperatures, key=key, token_map=token_map
    )
    return path, candidates, probs, k_cache, v_cache


def select_path(
    model: DFlash2DraftModel,
    params: Params,
    hidden: jax.Array,
    lm_head: jax.Array,
    anchor_ids: jax.Array,
    *,
    temperatures: jax.Array | None = None,
    key: jax.Array | None = None,
    token_map: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`DFlash2DraftModel.propose` on JAX values: hidden [n, P, H] -> (path, candidates, q)."""
    with lowering():
        logits = jax_view(model.compute_logits(torch_view(hidden), torch_view(lm_head.astype(hidden.dtype))))
    gumbel = None
    if temperatures is not None:
        gumbel = jax.random.gumbel(key, (*hidden.shape[:2], model.top_k), jnp.float32)
        temperatures = temperatures.astype(jnp.float32)
    selector_params = {name[len(SELECTOR):]: value for name, value in params.items() if name.startswith(SELECTOR)}
    path, candidates, probs = call_model(
        model.candidate_selector, selector_params, hidden, logits, anchor_ids.astype(jnp.int32),
        temperature=temperatures, gumbel=gumbel, token_map=token_map,
    )
    return path.astype(jnp.int32), candidates.astype(jnp.int32), probs


def dense_draft_probs(candidates: np.ndarray, probs: np.ndarray, vocab_size: int, rows: int | None = None) -> jax.Array:
    """q over the K candidates -> q over the vocabulary [rows, B-1, V] (zero off the candidates;
    rows past n are all zero), the `draft_probs` of `jax_backend.sampling.rejection_accept`.
    That makes DFlash 2 sampling the reference's `_rejection_sample` with draft indices."""
    n, positions, top_k = np.shape(candidates)
    rows = n if rows is None else rows
    padded_ids = np.zeros((rows, positions, top_k), np.int32)
    padded_probs = np.zeros((rows, positions, top_k), np.float32)
    padded_ids[:n], padded_probs[:n] = candidates, probs
    return _scatter(jnp.asarray(padded_ids), jnp.asarray(padded_probs), vocab_size=vocab_size)


@functools.partial(jax.jit, static_argnames=("vocab_size",))
def _scatter(candidates: jax.Array, probs: jax.Array, *, vocab_size: int) -> jax.Array:
    rows, positions, _ = candidates.shape
    dense = jnp.zeros((rows, positions, vocab_size), jnp.float32)
    row = jnp.arange(rows)[:, None, None]
    position = jnp.arange(positions)[None, :, None]
    return dense.at[row, position, candidates].add(probs)
