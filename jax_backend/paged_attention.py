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
  context within 2x and a growing context compiles once per bucket, not per length. With
  `loop_to_longest` the loop stops after the chunks the longest sequence needs (a trip count
  computed on the device: free on CPU, where the host runs the loop anyway; on GPU it would be
  read back every iteration), so the cost follows the real context within one chunk;
- results are gathered back to the packed token rows.

`prefix_block_attention` is the variant the model uses: the pages hold only the cached prefix
and this step's K/V come as arrays (written to the pages after the layer loop); the math is the
same. Its new tokens attend to each other either in the dense per-sequence blocks above or, when
that computes more scores (a prefill batch with one long prompt), in fixed-size tiles of packed
rows (`choose_query_tile`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_QUERY_TILE = 128
# The CPU kernels' range: decode steps and verify blocks of up to this many tokens per sequence
# (prefill chunks keep XLA's batched dots). `prefix_block_attention` runs the whole attention as
# one call (`cpu_kernels.ragged_attention`, head size 64 or 128); `_attend_pages` the prefix part.
CPU_KERNEL_MAX_Q_LEN = 16


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


def _attend_pages(q, kv_pages, page_indices, limit, num_seqs, *, sm_scale, mask_value, chunk_tokens, longest=None,
                  cpu_kernel=False):
    """The online-softmax state of queries q over cache positions k < limit[s, j], chunk by chunk
    over the pages of `page_indices` (columns past a sequence's pages point at the scratch page 0
    and are masked by `limit`): all of its chunks, or only those below `longest` (a device scalar:
    no real query sees a position at or past it) when given.

    `cpu_kernel` (a CPU runner sets it; see `Batch.cpu_attention`): float32 steps of at most
    CPU_KERNEL_MAX_Q_LEN queries per sequence run `cpu_kernels.paged_prefix_attention` instead,
    which reads each cached K/V row once where it lies (XLA's gathers copy every chunk first)."""
    state = _init_state(q, mask_value)
    if page_indices.shape[1] == 0:
        return state
    if cpu_kernel and q.shape[1] <= CPU_KERNEL_MAX_Q_LEN and q.dtype == kv_pages.dtype == jnp.float32:
        from jax_backend import cpu_kernels

        return _SoftmaxState(*cpu_kernels.paged_prefix_attention(
            q, kv_pages, page_indices, limit, num_seqs, sm_scale=sm_scale, mask_value=mask_value))
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
    if longest is not None:  # 0 trips when no sequence has a cached prefix: the state stays empty
        return jax.lax.fori_loop(0, jnp.clip((longest + chunk - 1) // chunk, 0, num_chunks), body, state)
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


def _longest(lengths: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """The longest of the real sequences' `lengths` (padding sequences may hold anything)."""
    return jnp.max(jnp.where(jnp.arange(lengths.shape[0]) < num_seqs[0], lengths, 0))


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
    loop_to_longest: bool = False,
    cpu_kernel: bool = False,
) -> jax.Array:
    """Attention of packed ragged queries over paged K/V (new tokens already in the pages);
    returns [T, Hq, D].

    `max_q_len` (static) bounds every sequence's query count; None means T (always correct,
    slower). A bound smaller than a real q_len gives wrong results: callers that pad to buckets
    (see `jax_backend.batch`) know the bound. `loop_to_longest`: visit only the chunks holding
    the longest real sequence's context (a device-side trip count: for CPU; see the module doc).
    `cpu_kernel`: the cached prefix through the CPU kernel where it applies (`_attend_pages`).
    """
    _check_shapes(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, _ = queries.shape
    max_q_len = num_tokens if max_q_len is None else max_q_len
    layout = _query_layout(cu_q_lens, num_seqs, num_tokens, max_q_len)
    q = _dense_queries(queries, layout, kv_pages.shape[2] // 2)

    q_pos = (kv_lens - layout.q_lens)[:, None] + jnp.arange(max_q_len)[None, :]
    state = _attend_pages(
        q, kv_pages, page_indices, q_pos + 1, num_seqs,
        sm_scale=sm_scale, mask_value=mask_value, chunk_tokens=chunk_tokens,
        longest=_longest(kv_lens, num_seqs) if loop_to_longest else None, cpu_kernel=cpu_kernel,
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
    query_tile: int | None = None,
    loop_to_longest: bool = False,
    cpu_kernel: bool = False,
) -> jax.Array:
    """Same result as writing the new K/V into the pages and calling `ragged_paged_attention`,
    without the write: cache positions < kv_len - q_len come from the pages (anything stored at
    or after that position is ignored), the new tokens attend to each other causally.

    `query_tile`: how the new tokens attend to each other. 0: in each sequence's dense
    [max_q_len] block (S x Q x Q scores); a power of two: in tiles of that many packed rows, each
    over the window of rows a tile can need (T x (tile + Q) scores). None picks the cheaper: a
    prefill batch with one long prompt among short ones pays S x Q x Q for its longest prompt in
    the dense layout (8 prompts, 943 tokens, one of 310: Q = 512, 2.1M scores per head and layer
    against 0.66M in tiles of 128). `loop_to_longest`: as in `ragged_paged_attention`.
    `cpu_kernel`: float32 steps of at most CPU_KERNEL_MAX_Q_LEN queries per sequence and head size
    64 or 128 run as one CPU kernel call (`cpu_kernels.ragged_attention`: no query layout, page
    gathers or merges in XLA); other head sizes take the prefix part through `_attend_pages`'s kernel."""
    _check_shapes(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = queries.shape
    num_kv_heads = kv_pages.shape[2] // 2
    max_q_len = num_tokens if max_q_len is None else max_q_len
    if (cpu_kernel and max_q_len <= CPU_KERNEL_MAX_Q_LEN and head_dim in (64, 128)
            and queries.dtype == new_keys.dtype == kv_pages.dtype == jnp.float32):
        from jax_backend import cpu_kernels

        return cpu_kernels.ragged_attention(queries, new_keys, new_values, kv_pages, kv_lens, page_indices, cu_q_lens,
                                            num_seqs, sm_scale=sm_scale, mask_value=mask_value)
    if query_tile is None:
        query_tile = choose_query_tile(num_tokens, page_indices.shape[0], max_q_len)
    elif query_tile and num_tokens % query_tile:
        raise ValueError(f"query_tile {query_tile} does not divide the {num_tokens} query rows")
    layout = _query_layout(cu_q_lens, num_seqs, num_tokens, max_q_len)
    q = _dense_queries(queries, layout, num_kv_heads)

    prefix_lens = kv_lens - layout.q_lens
    limit = jnp.broadcast_to(prefix_lens[:, None], layout.rows.shape)
    state = _attend_pages(
        q, kv_pages, page_indices, limit, num_seqs,
        sm_scale=sm_scale, mask_value=mask_value, chunk_tokens=chunk_tokens,
        longest=_longest(prefix_lens, num_seqs) if loop_to_longest else None, cpu_kernel=cpu_kernel,
    )
    if query_tile:  # the cached prefix's part (if any) moves to the packed rows and is merged there
        prefix = _packed_state(state, layout) if page_indices.shape[1] else None
        return _tiled_new_tokens(queries, new_keys, new_values, layout, prefix, tile=query_tile,
                                 max_q_len=max_q_len, sm_scale=sm_scale, mask_value=mask_value)
    j = jnp.arange(max_q_len)
    causal = jnp.broadcast_to(j[None, None, :] <= j[None, :, None], (kv_lens.shape[0], max_q_len, max_q_len))
    state = _online_softmax_step(
        state, q, new_keys[layout.rows].transpose(0, 2, 1, 3), new_values[layout.rows].transpose(0, 2, 1, 3),
        causal, sm_scale, mask_value,
    )
    return _finish(state, layout, queries.dtype, num_q_heads)


def choose_query_tile(num_tokens: int, max_seqs: int, max_q_len: int, tile: int = DEFAULT_QUERY_TILE) -> int:
    """The query tile of `prefix_block_attention` for these static shapes: `tile`, or the largest
    divisor of num_tokens below it (a power of two for a power-of-two `tile`), when tiles compute
    fewer scores than the dense per-sequence blocks; else 0 (also for a tile under 16 rows)."""
    tile = math.gcd(tile, num_tokens)
    return tile if tile >= 16 and num_tokens * (tile + max_q_len) < max_seqs * max_q_len * max_q_len else 0


def _packed_state(state: _SoftmaxState, layout: _QueryLayout) -> _SoftmaxState:
    """A dense [S, Hkv, G, Qmax] state at the packed token rows: [T, Hkv, G](, D)."""
    s, o = layout.seq_of_token, layout.offset_in_seq
    return _SoftmaxState(state.m.transpose(0, 3, 1, 2)[s, o], state.l.transpose(0, 3, 1, 2)[s, o],
                         state.acc.transpose(0, 3, 1, 2, 4)[s, o])


def _tiled_new_tokens(queries, new_keys, new_values, layout, prefix, *, tile, max_q_len, sm_scale, mask_value):
    """The new tokens' causal attention to each other over the packed rows, `tile` query rows at
    a time, merged with the cached prefix's packed state (None: no prefix); returns [T, Hq, D].

    Tile i's queries (rows [i*tile, (i+1)*tile)) belong to sequences that start at most
    max_q_len - 1 rows before the tile, so the keys they can see lie in the window of
    tile + max_q_len rows ending with the tile (rows before 0 are padding). A key is visible to a
    query of the same sequence at or after it; every query sees at least itself."""
    num_tokens, num_q_heads, head_dim = queries.shape
    num_kv_heads = new_keys.shape[1]
    group = num_q_heads // num_kv_heads
    num_tiles, window = num_tokens // tile, tile + max_q_len
    key_rows = np.arange(num_tiles)[:, None] * tile + np.arange(window)[None, :] - max_q_len  # static
    query_rows = np.arange(num_tokens).reshape(num_tiles, tile)
    # Padding rows form a segment of their own (-1) so no real query sees them.
    segment = jnp.where(layout.token_valid, layout.seq_of_token, -1)
    key_segment = jnp.where(key_rows >= 0, segment[np.maximum(key_rows, 0)], -2)
    visible = (segment[query_rows][:, :, None] == key_segment[:, None, :]) & (
        key_rows[:, None, :] <= query_rows[:, :, None])

    def windows(x):  # [T, Hkv, D] -> [tiles, Hkv, window, D]
        return x[np.maximum(key_rows, 0)].transpose(0, 2, 1, 3)

    q = queries.reshape(num_tiles, tile, num_kv_heads, group, head_dim)
    scores = jnp.einsum("nqhgd,nhkd->nhgqk", q, windows(new_keys), preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores * sm_scale, mask_value)
    m = scores.max(axis=-1)
    p = jnp.exp(scores - m[..., None])
    l = p.sum(axis=-1)
    acc = jnp.einsum("nhgqk,nhkd->nhgqd", p.astype(new_values.dtype), windows(new_values),
                     preferred_element_type=jnp.float32)
    # -> packed rows [T, Hkv, G](, D)
    m, l = (x.transpose(0, 3, 1, 2).reshape(num_tokens, num_kv_heads, group) for x in (m, l))
    acc = acc.transpose(0, 3, 1, 2, 4).reshape(num_tokens, num_kv_heads, group, head_dim)
    if prefix is not None:  # merge two softmax partials (every real query's m is its own score's)
        m_both = jnp.maximum(m, prefix.m)
        a, b = jnp.exp(m - m_both), jnp.exp(prefix.m - m_both)
        l, acc = a * l + b * prefix.l, a[..., None] * acc + b[..., None] * prefix.acc
    out = (acc / l[..., None]).reshape(num_tokens, num_q_heads, head_dim).astype(queries.dtype)
    return jnp.where(layout.token_valid[:, None, None], out, jnp.zeros((), queries.dtype))


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
