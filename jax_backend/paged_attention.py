"""Pure-JAX, jittable ragged paged attention over an interleaved K/V page pool.

Semantics follow `jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel.
ref_ragged_paged_attention` (the TPU kernel's reference), so a Pallas kernel can replace this
function on TPU:
- `kv_pages[P, page_size, 2*Hkv, D]`: K and V interleaved on axis 2 (even = K, odd = V).
- sequence i owns query rows `cu_q_lens[i] : cu_q_lens[i+1]` and cache pages `page_indices[i]`;
  `kv_lens[i]` counts its cached tokens INCLUDING this step's new ones (written beforehand), so
  query j of sequence i sits at position `kv_lens[i] - q_len_i + j` and sees positions <= that.
- only the first `num_seqs[0]` sequences are real. Rows past `cu_q_lens[num_seqs]` are padding
  and come back as zeros (the reference returns only the real rows).

How: each sequence's pages are gathered once into a dense [pages_per_seq * page_size] K/V strip
(`gather_kv_strips`), its queries into a dense [max_q_len] block, one masked softmax runs per
sequence and the result is gathered back to the packed token rows (`attend_strips`). Cost is proportional to
num_seqs * max_q_len * pages_per_seq * page_size, all static, so there is one compilation per
bucket of shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def ragged_paged_attention(
    queries: jax.Array,  # [T, Hq, D]
    kv_pages: jax.Array,  # [P, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    mask_value: float = DEFAULT_MASK_VALUE,
    max_q_len: int | None = None,
) -> jax.Array:
    """Attention of packed ragged queries over paged K/V; returns [T, Hq, D].

    `max_q_len` (static) bounds every sequence's query count; None means T (always correct,
    slower). Passing a bound smaller than a real q_len gives wrong results: callers that pad
    to buckets (see `jax_backend.batch`) know the bound.
    """
    num_q_heads, head_dim = queries.shape[1:]
    num_combined, head_dim_kv = kv_pages.shape[2:]
    max_seqs = page_indices.shape[0]
    if num_combined % 2 or head_dim_kv != head_dim or num_q_heads % (num_combined // 2):
        raise ValueError(
            f"incompatible shapes: queries {queries.shape}, kv_pages {kv_pages.shape} "
            "(need 2*Hkv combined heads, equal head_dim, Hq a multiple of Hkv)"
        )
    if kv_lens.shape != (max_seqs,) or cu_q_lens.shape != (max_seqs + 1,) or num_seqs.shape != (1,):
        raise ValueError(
            f"kv_lens {kv_lens.shape}, cu_q_lens {cu_q_lens.shape}, num_seqs {num_seqs.shape} "
            f"do not match page_indices {page_indices.shape}"
        )
    keys, values = gather_kv_strips(kv_pages, page_indices)
    return attend_strips(
        queries, keys, values, kv_lens, cu_q_lens, num_seqs,
        sm_scale=sm_scale, mask_value=mask_value, max_q_len=max_q_len,
    )


def gather_kv_strips(kv_pages: jax.Array, page_indices: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each sequence's pages as dense K and V strips [S, pages_per_seq * page_size, Hkv, D]."""
    _, page_size, num_combined, head_dim = kv_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    strips = kv_pages[page_indices].reshape(
        max_seqs, pages_per_seq * page_size, num_combined // 2, 2, head_dim
    )
    return strips[:, :, :, 0], strips[:, :, :, 1]


def token_seq_ids(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(sequence index [T] of every packed row, whether the row is a real token [T]).
    Row t belongs to sequence s(t) = number of real sequences ending at or before t."""
    max_seqs = cu_q_lens.shape[0] - 1
    t = jnp.arange(num_tokens)
    seq_valid = jnp.arange(max_seqs) < num_seqs[0]
    ends = jnp.where(seq_valid, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq_of_token = jnp.sum(ends[None, :] <= t[:, None], axis=1)
    return jnp.minimum(seq_of_token, max_seqs - 1), t < cu_q_lens[num_seqs[0]]


def attend_strips(
    queries: jax.Array,  # [T, Hq, D]
    keys: jax.Array,  # [S, Kmax, Hkv, D]
    values: jax.Array,  # [S, Kmax, Hkv, D]
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    mask_value: float = DEFAULT_MASK_VALUE,
    max_q_len: int | None = None,
) -> jax.Array:
    """The attention proper, over per-sequence K/V strips (see module docstring)."""
    num_tokens, num_q_heads, head_dim = queries.shape
    max_seqs, max_kv_len, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    max_q_len = num_tokens if max_q_len is None else max_q_len

    # Dense per-sequence query blocks: [S, max_q_len, Hkv, group, D].
    seq_valid = jnp.arange(max_seqs) < num_seqs[0]
    q_starts = cu_q_lens[:-1]
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - q_starts, 0)
    j = jnp.arange(max_q_len)
    rows = jnp.clip(q_starts[:, None] + j[None, :], 0, num_tokens - 1)
    q = queries[rows].reshape(max_seqs, max_q_len, num_kv_heads, group, head_dim)

    scores = jnp.einsum("sqhgd,skhd->shgqk", q, keys, preferred_element_type=jnp.float32)
    scores = scores * sm_scale
    q_pos = (kv_lens - q_lens)[:, None] + j[None, :]  # absolute position of each query
    visible = jnp.arange(max_kv_len)[None, None, :] <= q_pos[:, :, None]  # [S, Qmax, Kmax]
    scores = jnp.where(visible[:, None, None], scores, mask_value)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    dense_out = jnp.einsum("shgqk,skhd->sqhgd", probs, values).astype(queries.dtype)
    dense_out = dense_out.reshape(max_seqs, max_q_len, num_q_heads, head_dim)

    # Back to packed rows.
    seq_of_token, token_valid = token_seq_ids(cu_q_lens, num_seqs, num_tokens)
    offset_in_seq = jnp.clip(jnp.arange(num_tokens) - cu_q_lens[seq_of_token], 0, max_q_len - 1)
    out = dense_out[seq_of_token, offset_in_seq]
    return jnp.where(token_valid[:, None, None], out, jnp.zeros((), out.dtype))


def interleave_kv(keys: jax.Array, values: jax.Array) -> jax.Array:
    """[T, Hkv, D] K and V -> [T, 2*Hkv, D] with K on even and V on odd heads."""
    num_tokens, num_kv_heads, head_dim = keys.shape
    return jnp.stack([keys, values], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)


def write_kv(kv_pages: jax.Array, new_kv: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new interleaved K/V rows into pages: `kv_pages[..., P, page_size, 2*Hkv, D]`,
    `new_kv[..., T, 2*Hkv, D]` (same leading dims, e.g. one per layer), `slot_mapping[T]` with
    `slot = page * page_size + offset`.

    Padding tokens point into the reserved scratch page 0; several may hit the same slot, which
    is harmless because page 0 is never read as a real sequence's page.
    """
    *lead, num_pages, page_size, num_combined, head_dim = kv_pages.shape
    flat = kv_pages.reshape(*lead, num_pages * page_size, num_combined, head_dim)
    flat = flat.at[..., slot_mapping, :, :].set(new_kv.astype(flat.dtype))
    return flat.reshape(kv_pages.shape)
