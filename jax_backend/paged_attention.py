"""Pure-JAX, jittable ragged paged attention over an interleaved K/V page pool.

Semantics follow `jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel.
ref_ragged_paged_attention` (the TPU kernel's reference), so a Pallas kernel can replace
`ragged_paged_attention` on TPU:
- `kv_pages[P, page_size, 2*Hkv, D]`: K and V interleaved on axis 2 (even = K, odd = V).
- sequence i owns query rows `cu_q_lens[i] : cu_q_lens[i+1]` and cache pages `page_indices[i]`;
  `kv_lens[i]` counts its cached tokens INCLUDING this step's new ones (written beforehand), so
  query j of sequence i sits at position `kv_lens[i] - q_len_i + j` and sees positions <= that.
- only the first `num_seqs[0]` sequences are real. Rows past `cu_q_lens[num_seqs]` are padding
  and come back as zeros (the reference returns only the real rows).

How (static shapes, cost proportional to the real context, not to the page-table width):
- each sequence's queries are gathered into a dense [max_q_len] block (`max_q_len` static);
- the cache is visited in chunks of `chunk_tokens` positions with an online softmax (flash
  attention style) over EVERY column of `page_indices`: the number of chunks is static (XLA knows
  the loop's trip count; on GPU a data-dependent trip count is read on the host every iteration).
  The caller sizes the page table to the batch's context: `jax_backend.batch` makes its width the
  longest cached prefix in pages rounded up to a power of two, so the cost follows the real
  context within 2x and a growing context compiles once per bucket, not per length;
- results are gathered back to the packed token rows.

`prefix_block_attention` is the variant the model uses: the pages hold only the cached prefix
and this step's K/V come as arrays (written to the pages after the layer loop); the math is the
same.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
DEFAULT_CHUNK_TOKENS = 256


class _QueryLayout(NamedTuple):
    rows: jax.Array  # [S, Qmax] packed row of query j of sequence s (clamped)
    q_lens: jax.Array  # [S] (0 for padding sequences)
    seq_of_token: jax.Array  # [T]
    offset_in_seq: jax.Array  # [T]
    token_valid: jax.Array  # [T]


def _query_layout(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, max_q_len: int) -> _QueryLayout:
    max_seqs = cu_q_lens.shape[0] - 1
    seq_valid = jnp.arange(max_seqs) < num_seqs[0]
    q_starts = cu_q_lens[:-1]
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - q_starts, 0)
    rows = jnp.clip(q_starts[:, None] + jnp.arange(max_q_len)[None, :], 0, num_tokens - 1)
    # Row t belongs to s(t) = number of real sequences ending at or before t.
    t = jnp.arange(num_tokens)
    ends = jnp.where(seq_valid, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq_of_token = jnp.minimum(jnp.sum(ends[None, :] <= t[:, None], axis=1), max_seqs - 1)
    offset_in_seq = jnp.clip(t - cu_q_lens[seq_of_token], 0, max_q_len - 1)
    return _QueryLayout(rows, q_lens, seq_of_token, offset_in_seq, t < cu_q_lens[num_seqs[0]])


class _SoftmaxState(NamedTuple):
    m: jax.Array  # [S, Hkv, G, Qmax] running max (starts at mask_value, finite)
    l: jax.Array  # [S, Hkv, G, Qmax] running denominator
    acc: jax.Array  # [S, Hkv, G, Qmax, D] running numerator (float32)


def _init_state(q: jax.Array, mask_value: float) -> _SoftmaxState:
    s, qm, h, g, d = q.shape
    return _SoftmaxState(
        jnp.full((s, h, g, qm), mask_value, jnp.float32),
        jnp.zeros((s, h, g, qm), jnp.float32),
        jnp.zeros((s, h, g, qm, d), jnp.float32),
    )


def _online_softmax_step(state, q, keys, values, visible, sm_scale, mask_value):
    """Fold keys/values [S, Hkv, K, D] (head-major: each (sequence, head) pair's keys are one
    contiguous matrix, as the batched dots want them) with mask visible [S, Qmax, K] into the state.

    Masked scores are set to the finite `mask_value` like the TPU reference: a query that has
    seen only masked keys carries weight-1 garbage, which the first visible key (every real query
    has one: itself) scales away by exp(mask_value - score) = 0."""
    scores = jnp.einsum("sqhgd,shkd->shgqk", q, keys, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores * sm_scale, mask_value)
    m_new = jnp.maximum(state.m, scores.max(axis=-1))
    alpha = jnp.exp(state.m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    l_new = alpha * state.l + p.sum(axis=-1)
    pv = jnp.einsum("shgqk,shkd->shgqd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return _SoftmaxState(m_new, l_new, alpha[..., None] * state.acc + pv)


def _attend_pages(state, q, kv_pages, page_indices, limit, *, sm_scale, mask_value, chunk_tokens):
    """Fold cache positions k < limit[s, j] into the state, chunk by chunk over all the pages of
    `page_indices` (a static number of chunks; columns past a sequence's pages point at the
    scratch page 0 and are masked by `limit`)."""
    _, page_size, num_combined, head_dim = kv_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    chunk_pages = max(1, min(chunk_tokens // page_size, pages_per_seq))
    chunk = chunk_pages * page_size
    num_chunks = -(-pages_per_seq // chunk_pages)
    page_indices = jnp.pad(page_indices, ((0, 0), (0, num_chunks * chunk_pages - pages_per_seq)))

    def body(c, state):
        pages = jax.lax.dynamic_slice_in_dim(page_indices, c * chunk_pages, chunk_pages, axis=1)
        positions = c * chunk + jnp.arange(chunk)
        visible = positions[None, None, :] < limit[:, :, None]
        return _online_softmax_step(state, q, _gather_heads(kv_pages, pages, 0), _gather_heads(kv_pages, pages, 1),
                                    visible, sm_scale, mask_value)

    if num_chunks <= 1:  # no loop at all for a short context (0 chunks: no cached prefix)
        return body(0, state) if num_chunks else state
    return jax.lax.fori_loop(0, num_chunks, body, state)


def _gather_heads(kv_pages, pages, which):
    """K (which=0) or V (1) of the pages [S, n] as head-major [S, Hkv, n * page_size, D].

    One gather each, reading the interleaved pool strided and writing the layout the dots take:
    XLA fuses the slice, the gather and the transpose into one pass. (Gathering whole pages and
    de-interleaving after wrote the chunk three times: at 32 sequences x 256 tokens, 4.0 -> 3.0 ms
    per layer on 2 CPU cores.)"""
    num_pages, page_size, num_combined, head_dim = kv_pages.shape
    max_seqs, n = pages.shape
    half = kv_pages.reshape(num_pages, page_size, num_combined // 2, 2, head_dim)[:, :, :, which]
    by_head = half.transpose(0, 2, 1, 3)[pages]  # [S, n, Hkv, page_size, D]
    return by_head.transpose(0, 2, 1, 3, 4).reshape(max_seqs, num_combined // 2, n * page_size, head_dim)


def _finish(state, layout, out_dtype, num_q_heads):
    s, h, g, qm, d = state.acc.shape
    dense = (state.acc / state.l[..., None]).transpose(0, 3, 1, 2, 4).reshape(s, qm, num_q_heads, d)
    out = dense[layout.seq_of_token, layout.offset_in_seq].astype(out_dtype)
    return jnp.where(layout.token_valid[:, None, None], out, jnp.zeros((), out_dtype))


def _check_shapes(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
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


def _dense_queries(queries, layout, num_kv_heads):
    num_tokens, num_q_heads, head_dim = queries.shape
    max_seqs, max_q_len = layout.rows.shape
    return queries[layout.rows].reshape(
        max_seqs, max_q_len, num_kv_heads, num_q_heads // num_kv_heads, head_dim
    )


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
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> jax.Array:
    """Attention of packed ragged queries over paged K/V (new tokens already in the pages);
    returns [T, Hq, D].

    `max_q_len` (static) bounds every sequence's query count; None means T (always correct,
    slower). A bound smaller than a real q_len gives wrong results: callers that pad to buckets
    (see `jax_backend.batch`) know the bound.
    """
    _check_shapes(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, _ = queries.shape
    max_q_len = num_tokens if max_q_len is None else max_q_len
    layout = _query_layout(cu_q_lens, num_seqs, num_tokens, max_q_len)
    q = _dense_queries(queries, layout, kv_pages.shape[2] // 2)

    q_pos = (kv_lens - layout.q_lens)[:, None] + jnp.arange(max_q_len)[None, :]
    state = _attend_pages(
        _init_state(q, mask_value), q, kv_pages, page_indices, q_pos + 1,
        sm_scale=sm_scale, mask_value=mask_value, chunk_tokens=chunk_tokens,
    )
    return _finish(state, layout, queries.dtype, num_q_heads)


def prefix_block_attention(
    queries: jax.Array,  # [T, Hq, D]
    new_keys: jax.Array,  # [T, Hkv, D] this step's keys (not in the pages)
    new_values: jax.Array,  # [T, Hkv, D]
    kv_pages: jax.Array,  # [P, page_size, 2*Hkv, D] holding each sequence's cached prefix
    kv_lens: jax.Array,  # i32[S] prefix + new tokens, as in `ragged_paged_attention`
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float = 1.0,
    mask_value: float = DEFAULT_MASK_VALUE,
    max_q_len: int | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> jax.Array:
    """Same result as writing the new K/V into the pages and calling `ragged_paged_attention`,
    without the write: cache positions < kv_len - q_len come from the pages (anything stored at
    or after that position is ignored), the new tokens attend to each other causally."""
    _check_shapes(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, _ = queries.shape
    num_kv_heads = kv_pages.shape[2] // 2
    max_q_len = num_tokens if max_q_len is None else max_q_len
    layout = _query_layout(cu_q_lens, num_seqs, num_tokens, max_q_len)
    q = _dense_queries(queries, layout, num_kv_heads)

    prefix_lens = kv_lens - layout.q_lens
    limit = jnp.broadcast_to(prefix_lens[:, None], layout.rows.shape)
    state = _attend_pages(
        _init_state(q, mask_value), q, kv_pages, page_indices, limit,
        sm_scale=sm_scale, mask_value=mask_value, chunk_tokens=chunk_tokens,
    )
    j = jnp.arange(max_q_len)
    causal = jnp.broadcast_to(j[None, None, :] <= j[None, :, None], (kv_lens.shape[0], max_q_len, max_q_len))
    state = _online_softmax_step(
        state, q, new_keys[layout.rows].transpose(0, 2, 1, 3), new_values[layout.rows].transpose(0, 2, 1, 3),
        causal, sm_scale, mask_value,
    )
    return _finish(state, layout, queries.dtype, num_q_heads)


def interleave_kv(keys: jax.Array, values: jax.Array) -> jax.Array:
    """[..., T, Hkv, D] K and V -> [..., T, 2*Hkv, D] with K on even and V on odd heads."""
    *lead, num_kv_heads, head_dim = keys.shape
    return jnp.stack([keys, values], axis=-2).reshape(*lead, 2 * num_kv_heads, head_dim)


def write_kv(kv_pages: jax.Array, new_kv: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new interleaved K/V rows into pages: `kv_pages[..., P, page_size, 2*Hkv, D]`,
    `new_kv[..., T, 2*Hkv, D]` (same leading dims, e.g. one per layer), `slot_mapping[T]` with
    `slot = page * page_size + offset`.

    Padding tokens point into the reserved scratch page 0; several may hit the same slot, which
    is harmless because page 0 is never read as a real sequence's page.
    """
    *lead, num_pages, page_size, num_combined, head_dim = kv_pages.shape
    if slot_mapping.shape[0] == 1:
        # XLA:CPU lowers a one-row scatter to a dynamic-update-slice and copies the whole pool
        # first; one extra row into scratch slot 0 keeps it an in-place scatter. (Padding the
        # whole batch to two tokens instead made every decode matmul a 2-row GEMM: ~15% of a
        # B=1 step on XLA:CPU, whose 1-row GEMV reads weights much faster.)
        new_kv = jnp.concatenate([new_kv, jnp.zeros_like(new_kv[..., :1, :, :])], axis=-3)
        slot_mapping = jnp.concatenate([slot_mapping, jnp.zeros_like(slot_mapping)])
    flat = kv_pages.reshape(*lead, num_pages * page_size, num_combined, head_dim)
    flat = flat.at[..., slot_mapping, :, :].set(new_kv.astype(flat.dtype))
    return flat.reshape(kv_pages.shape)
