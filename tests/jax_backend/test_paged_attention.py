"""Ragged paged attention vs a dense reference and JAX's TPU reference; K/V writes; the page
allocator; batch packing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
    ref_ragged_paged_attention,
)

from jax_backend import BatchError, OutOfPages, PageAllocator, SeqInput, build_batch
from jax_backend.batch import bucket, fine_bucket
from jax_backend.paged_attention import (
    choose_query_tile,
    interleave_kv,
    prefix_block_attention,
    ragged_paged_attention,
    write_kv,
)
from tests.jax_backend.allocator_utils import truncate

PAGE, NUM_PAGES, PAGES_PER_SEQ, HEAD_DIM = 4, 40, 8, 16


def _dense_reference(q, k, v, sm_scale):
    """Plain causal GQA attention for one sequence whose last q_len keys are the queries'."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * sm_scale
    q_pos = kv_len - q_len + np.arange(q_len)
    scores = np.where(np.arange(kv_len)[None, None] <= q_pos[None, :, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def _mixed_case(num_q_heads, num_kv_heads, seed=0):
    """Prefill (13 new tokens), decode (1 new after 20 cached), verify (8 new after 11 cached,
    crossing page boundaries), plus a second decode; pages scattered over the pool; T and S
    padded beyond the real tokens/sequences, with garbage in the padded rows."""
    rng = np.random.default_rng(seed)
    specs = [(13, 13), (1, 21), (8, 19), (1, 5)]  # (q_len, kv_len)
    max_seqs, num_tokens = 8, 32
    pool = rng.standard_normal((NUM_PAGES, PAGE, 2 * num_kv_heads, HEAD_DIM), np.float32)
    pages = rng.permutation(np.arange(1, NUM_PAGES))  # non-contiguous, never the scratch page 0
    page_indices, kv_lens, cu_q_lens = pack_specs(specs, pages, np.zeros(max_seqs, np.int32), PAGES_PER_SEQ, PAGE)
    queries = rng.standard_normal((num_tokens, num_q_heads, HEAD_DIM), np.float32)
    arrays = dict(
        queries=queries,
        kv_pages=pool,
        kv_lens=kv_lens,
        page_indices=page_indices,
        cu_q_lens=cu_q_lens,
        num_seqs=np.array([len(specs)], np.int32),
    )
    return {k: jnp.asarray(v) for k, v in arrays.items()}, specs


def pack_specs(specs, pages, kv_lens, pages_per_seq, page_size):
    """Page table [S, pages_per_seq], kv_lens and cu_q_lens [S + 1] of sequences (q_len, kv_len),
    their pages taken in turn from `pages`; rows of `kv_lens` past the specs (padding) are kept."""
    max_seqs = kv_lens.shape[0]
    page_indices = np.zeros((max_seqs, pages_per_seq), np.int32)
    cu_q_lens = np.zeros(max_seqs + 1, np.int32)
    used = 0
    for i, (q_len, kv_len) in enumerate(specs):
        n = -(-kv_len // page_size)
        page_indices[i, :n] = pages[used : used + n]
        used += n
        kv_lens[i] = kv_len
        cu_q_lens[i + 1] = cu_q_lens[i] + q_len
    cu_q_lens[len(specs) + 1 :] = cu_q_lens[len(specs)]
    return page_indices, kv_lens, cu_q_lens


def _ours(args, max_q_len, chunk_tokens=8):
    fn = functools.partial(
        ragged_paged_attention, sm_scale=HEAD_DIM**-0.5, max_q_len=max_q_len, chunk_tokens=chunk_tokens
    )
    return np.asarray(jax.jit(fn)(**args))


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, chunk_tokens",
    # chunk 4 = one page per chunk, 8 = two pages, 256 = the whole page table in one chunk
    [(4, 2, 8), (3, 3, 4), (8, 1, 256)],
)
def test_matches_dense_reference(num_q_heads, num_kv_heads, chunk_tokens):
    args, specs = _mixed_case(num_q_heads, num_kv_heads)
    real = int(args["cu_q_lens"][len(specs)])
    ours = _ours(args, max_q_len=16, chunk_tokens=chunk_tokens)  # the bound build_batch would pass
    np.testing.assert_allclose(_ours(args, max_q_len=None), ours, atol=1e-5, rtol=0)
    assert np.all(ours[real:] == 0)  # padding rows

    pool = np.asarray(args["kv_pages"])
    queries = np.asarray(args["queries"])
    for i, (q_len, kv_len) in enumerate(specs):
        strip = pool[np.asarray(args["page_indices"][i])].reshape(-1, 2 * num_kv_heads, HEAD_DIM)
        k, v = strip[:kv_len, 0::2], strip[:kv_len, 1::2]
        start = int(args["cu_q_lens"][i])
        expected = _dense_reference(queries[start : start + q_len], k, v, HEAD_DIM**-0.5)
        np.testing.assert_allclose(ours[start : start + q_len], expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_matches_jax_tpu_reference():
    """Same semantics as the TPU kernel's reference (which is eager and slow: one case)."""
    args, specs = _mixed_case(4, 2, seed=3)
    real = int(args["cu_q_lens"][len(specs)])
    tpu_ref = np.asarray(ref_ragged_paged_attention(**args, sm_scale=HEAD_DIM**-0.5))
    assert tpu_ref.shape[0] == real
    np.testing.assert_allclose(_ours(args, max_q_len=16)[:real], tpu_ref, atol=1e-5, rtol=0)


def test_padding_and_stale_entries_are_ignored():
    """Garbage past kv_len in a sequence's pages, and anything in the scratch page or in padded
    page-table slots, must not change the real outputs."""
    args, specs = _mixed_case(4, 2, seed=1)
    base = _ours(args, max_q_len=16)
    pool = np.array(args["kv_pages"])
    pool[0] = 1e4  # scratch page
    for i, (_, kv_len) in enumerate(specs):  # stale tail of each sequence's last page
        last_page = args["page_indices"][i, (kv_len - 1) // PAGE]
        pool[int(last_page), kv_len % PAGE or PAGE :] = -1e4
    noisy = dict(args, kv_pages=jnp.asarray(pool))
    out = _ours(noisy, max_q_len=16)
    np.testing.assert_allclose(out, base, atol=1e-6, rtol=0)


def test_prefix_block_attention_equals_write_then_attend():
    """The model's variant (prefix from the pages, new K/V as arrays) equals writing the new
    K/V into the pages first; whatever the pages hold at the new positions is ignored."""
    args, specs = _mixed_case(4, 2, seed=4)
    rng = np.random.default_rng(5)
    num_tokens = args["queries"].shape[0]
    k = jnp.asarray(rng.standard_normal((num_tokens, 2, HEAD_DIM), np.float32))
    v = jnp.asarray(rng.standard_normal((num_tokens, 2, HEAD_DIM), np.float32))
    slots = np.zeros(num_tokens, np.int32)  # padding rows -> scratch page 0
    for i, (q_len, kv_len) in enumerate(specs):
        start = int(args["cu_q_lens"][i])
        for j, pos in enumerate(range(kv_len - q_len, kv_len)):
            slots[start + j] = int(args["page_indices"][i, pos // PAGE]) * PAGE + pos % PAGE
    written = dict(args, kv_pages=write_kv(args["kv_pages"], interleave_kv(k, v), jnp.asarray(slots)))
    expected = _ours(written, max_q_len=16)

    fn = functools.partial(prefix_block_attention, sm_scale=HEAD_DIM**-0.5, max_q_len=16, chunk_tokens=8)
    rest = {name: value for name, value in args.items() if name != "queries"}
    ours = np.asarray(jax.jit(fn)(args["queries"], k, v, **rest))  # pages: stale data at new slots
    np.testing.assert_allclose(ours, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_tokens", [4, 8])
def test_loop_to_longest_equals_every_chunk_and_reads_no_further(chunk_tokens):
    """With `loop_to_longest` attention stops after the chunks the longest cached prefix needs
    (21 tokens: 3 of the page table's 4 chunks of 8, 6 of 8 chunks of 4): the same outputs as
    visiting every chunk, and pages named only past those chunks are never read (NaN there
    poisons the every-chunk result through its zero weights, not this one)."""
    args, specs = _mixed_case(4, 2, seed=8)
    table = np.array(args["page_indices"])
    assert max(kv_len for _, kv_len in specs) == 21 and table.shape[1] * PAGE == 32
    needed_columns = -(-21 // chunk_tokens) * chunk_tokens // PAGE
    pool = np.array(args["kv_pages"])
    poison = min(set(range(1, NUM_PAGES)) - set(table.flat))  # a page no sequence owns
    pool[poison] = np.nan
    table[:, needed_columns:] = poison
    args = dict(args, kv_pages=jnp.asarray(pool), page_indices=jnp.asarray(table))
    rng = np.random.default_rng(9)
    num_tokens = args["queries"].shape[0]
    k, v = (jnp.asarray(rng.standard_normal((num_tokens, 2, HEAD_DIM), np.float32)) for _ in range(2))

    def run(fn, loop_to_longest, arrays, *extra):
        fn = functools.partial(fn, sm_scale=HEAD_DIM**-0.5, max_q_len=16, chunk_tokens=chunk_tokens,
                               loop_to_longest=loop_to_longest)
        return np.asarray(jax.jit(fn)(arrays["queries"], *extra, **{n: a for n, a in arrays.items() if n != "queries"}))

    clean = dict(args, page_indices=jnp.where(args["page_indices"] == poison, 0, args["page_indices"]))
    for fn, extra in ((ragged_paged_attention, ()), (prefix_block_attention, (k, v))):
        expected = run(fn, False, clean, *extra)
        assert np.isfinite(expected).all()
        np.testing.assert_array_equal(run(fn, True, args, *extra), expected)
        assert np.isnan(run(fn, False, args, *extra)).any()
    no_prefix = dict(args, kv_lens=jnp.diff(args["cu_q_lens"]))  # every sequence a prefill: no chunk read
    assert np.isfinite(run(prefix_block_attention, True, no_prefix, k, v)).all()
    assert np.isnan(run(prefix_block_attention, False, no_prefix, k, v)).any()


@pytest.mark.parametrize("query_tile", [4, 8, 32])
@pytest.mark.parametrize("cached_prefix", [True, False])
def test_query_tiles_equal_dense_blocks(query_tile, cached_prefix):
    """The new tokens attending to each other in tiles of packed rows (merged with the cached
    prefix's part, or alone when nothing is cached) gives the dense per-sequence result, which
    in turn equals plain causal attention per sequence."""
    args, specs = _mixed_case(4, 2, seed=6)
    rng = np.random.default_rng(7)
    num_tokens = args["queries"].shape[0]
    k = rng.standard_normal((num_tokens, 2, HEAD_DIM), np.float32)
    v = rng.standard_normal((num_tokens, 2, HEAD_DIM), np.float32)
    rest = {name: value for name, value in args.items() if name != "queries"}
    if not cached_prefix:  # every sequence a prefill: empty page table, kv_len = q_len
        rest.update(page_indices=rest["page_indices"][:, :0], kv_lens=jnp.diff(rest["cu_q_lens"]))

    def run(tile):
        fn = functools.partial(prefix_block_attention, sm_scale=HEAD_DIM**-0.5, max_q_len=16, chunk_tokens=8,
                               query_tile=tile)
        return np.asarray(jax.jit(fn)(args["queries"], jnp.asarray(k), jnp.asarray(v), **rest))

    dense, tiled = run(0), run(query_tile)
    np.testing.assert_allclose(tiled, dense, atol=1e-5, rtol=0)
    real = int(args["cu_q_lens"][len(specs)])
    assert np.all(tiled[real:] == 0)
    if not cached_prefix:
        queries = np.asarray(args["queries"])
        for i, (q_len, _) in enumerate(specs):
            rows = slice(int(args["cu_q_lens"][i]), int(args["cu_q_lens"][i]) + q_len)
            expected = _dense_reference(queries[rows], k[rows], v[rows], HEAD_DIM**-0.5)
            np.testing.assert_allclose(tiled[rows], expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="query_tile 12 does not divide the 32 query rows"):
        jax.jit(functools.partial(prefix_block_attention, max_q_len=16, query_tile=12))(
            args["queries"], jnp.asarray(k), jnp.asarray(v), **rest)


def test_choose_query_tile_takes_tiles_only_where_they_compute_less():
    # 8 prompts, 943 tokens, the longest 310: dense 8 x 512 x 512 scores, tiles 1024 x (128 + 512)
    assert choose_query_tile(1024, 8, 512) == 128
    assert choose_query_tile(512, 4, 256) == 128  # one prompt of 200 and three of 20
    assert choose_query_tile(1024, 8, 128) == 0  # 8 prompts of 100: dense blocks have no waste
    assert choose_query_tile(512, 1, 512) == 0  # one sequence
    assert choose_query_tile(64, 32, 2) == 0  # decode / verify
    assert choose_query_tile(640, 4, 256) == 128  # fine-bucketed prefill rows: 5 tiles
    assert choose_query_tile(320, 4, 256) == 64  # the largest power of two dividing the rows
    assert choose_query_tile(40, 2, 32) == 0  # tiles of 8 rows: too small to pay


def test_write_kv_scatters_to_slots_and_scratch():
    rng = np.random.default_rng(2)
    layers = 2
    pool = jnp.asarray(rng.standard_normal((layers, 6, PAGE, 4, HEAD_DIM), np.float32))
    k = jnp.asarray(rng.standard_normal((layers, 5, 2, HEAD_DIM), np.float32))
    v = jnp.asarray(rng.standard_normal((layers, 5, 2, HEAD_DIM), np.float32))
    kv = jnp.stack([interleave_kv(k[l], v[l]) for l in range(layers)])
    np.testing.assert_array_equal(kv[:, :, 0::2], k)
    np.testing.assert_array_equal(kv[:, :, 1::2], v)
    # Three real tokens at positions 2, 3, 4 of a sequence with page table [5, 2]; two padding.
    slots = jnp.array([5 * PAGE + 2, 5 * PAGE + 3, 2 * PAGE + 0, 0, 0], jnp.int32)
    new = np.asarray(write_kv(pool, kv, slots))
    np.testing.assert_array_equal(np.asarray(write_kv(pool[1], kv[1], slots)), new[1])  # no layer dim
    old = np.asarray(pool)
    for l in range(layers):
        np.testing.assert_array_equal(new[l, 5, 2], kv[l, 0])
        np.testing.assert_array_equal(new[l, 5, 3], kv[l, 1])
        np.testing.assert_array_equal(new[l, 2, 0], kv[l, 2])
        changed = np.argwhere(np.any(new[l] != old[l], axis=(2, 3)))
        assert {tuple(x) for x in changed} <= {(5, 2), (5, 3), (2, 0), (0, 0)}


def test_page_allocator():
    alloc = PageAllocator(num_pages=6, page_size=4)  # 5 usable pages
    assert alloc.num_free_pages == 5
    assert alloc.pages_needed("a", 9) == 3
    assert alloc.allocate("a", 9) == [1, 2, 3]
    assert alloc.allocate("a", 12) == [1, 2, 3]  # already fits
    assert alloc.pages_needed("a", 13) == 1
    assert alloc.allocate("b", 5) == [4, 5]
    with pytest.raises(OutOfPages, match="needs 1 more pages"):
        alloc.allocate("a", 13)
    assert alloc.page_table("a") == [1, 2, 3] and alloc.num_free_pages == 0  # all or nothing
    assert alloc.free("b") == 2 and "b" not in alloc
    assert alloc.free("b") == 0
    assert truncate(alloc, "a", 5) == 1 and alloc.page_table("a") == [1, 2]
    table = alloc.allocate("c", 12)
    assert 0 not in table and len(set(table)) == 3 and not set(table) & {1, 2}
    with pytest.raises(KeyError, match="unknown sequence"):
        alloc.page_table("zzz")
    with pytest.raises(ValueError, match="scratch"):
        PageAllocator(num_pages=1, page_size=4)


def test_build_batch_buckets_and_layout():
    seqs = [
        SeqInput([5, 6, 7], start_pos=0, page_table=[3], logits="all"),
        SeqInput([9], start_pos=6, page_table=[4, 7]),
        SeqInput([1, 2, 3, 4, 5], start_pos=2, page_table=[8, 2], logits="last"),
    ]
    batch, layout = build_batch(seqs, page_size=4, pages_per_seq=4)
    assert batch.tokens.shape == (16,) and batch.kv_lens.shape == (4,)
    # Page table width = longest cached prefix (6 tokens = 2 pages), a power of two.
    assert batch.page_indices.shape == (4, 2) and batch.logits_indices.shape == (8,)
    np.testing.assert_array_equal(batch.page_indices, [[3, 0], [4, 7], [8, 2], [0, 0]])
    assert batch.max_q_len == 8
    np.testing.assert_array_equal(batch.tokens[:9], [5, 6, 7, 9, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(batch.positions[:9], [0, 1, 2, 6, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(
        batch.slot_mapping[:9], [12, 13, 14, 7 * 4 + 2, 8 * 4 + 2, 8 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2]
    )
    assert np.all(np.asarray(batch.slot_mapping[9:]) == 0)  # padding -> scratch page
    np.testing.assert_array_equal(batch.kv_lens, [3, 7, 7, 0])
    np.testing.assert_array_equal(batch.cu_q_lens, [0, 3, 4, 9, 9])
    np.testing.assert_array_equal(batch.logits_indices[:5], [0, 1, 2, 3, 8])
    assert layout.token_starts == (0, 3, 4) and layout.logit_starts == (0, 3, 4)
    assert layout.num_logits == (3, 1, 1)


def test_fine_token_buckets_pad_prefills_by_at_most_a_quarter():
    assert [fine_bucket(n) for n in (1, 3, 33, 64, 65, 77, 200, 256, 257, 300, 321, 512, 513, 800, 1025)] == [
        1, 4, 64, 64, 80, 80, 224, 256, 320, 320, 384, 512, 640, 896, 1280]
    assert fine_bucket(300, minimum=1024) == 1024
    for n in range(65, 5000, 37):
        assert n <= fine_bucket(n) <= bucket(n) and fine_bucket(n) < 1.25 * n
    seqs = [SeqInput(list(range(100)), 0, list(range(1 + 8 * i, 9 + 8 * i))) for i in range(8)]
    assert build_batch(seqs, page_size=16, pages_per_seq=8)[0].tokens.shape == (1024,)
    fine, layout = build_batch(seqs, page_size=16, pages_per_seq=8, fine_tokens=True)
    assert fine.tokens.shape == (896,) and layout.token_starts[-1] == 700


def test_build_batch_page_table_width_is_the_context_bucket():
    """Attention visits every page-table column (a static trip count), so the width follows the
    longest cached prefix in pages, rounded up to a power of two, within [min_pages, pages_per_seq]."""
    def width(start_pos, **kw):
        seq = SeqInput([1], start_pos, list(range(1, 2 + start_pos // 4)))
        return build_batch([seq], page_size=4, pages_per_seq=16, **kw)[0].page_indices.shape[1]

    assert width(0) == 0  # nothing cached: no page is read
    assert [width(n) for n in (1, 4, 5, 9, 17, 33, 60)] == [1, 1, 2, 4, 8, 16, 16]
    assert width(5, min_pages=4) == 4


@pytest.mark.parametrize(
    "seq, message",
    [
        (SeqInput([], 0, [1]), "token_ids is empty"),
        (SeqInput([1, 2], 3, [1]), "need 2"),
        (SeqInput([1], 0, [0]), "reserved as scratch"),
        (SeqInput([1], 0, [1, 2, 3, 4, 5]), "more than pages_per_seq"),
        (SeqInput([1], -1, [1]), "start_pos"),
        (SeqInput([1], 0, [1], logits="first"), "logits must be"),
    ],
)
def test_build_batch_errors(seq, message):
    with pytest.raises(BatchError, match=message):
        build_batch([seq], page_size=4, pages_per_seq=4)
