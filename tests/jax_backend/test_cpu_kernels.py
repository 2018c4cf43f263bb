"""The CPU attention kernel (`jax_backend.cpu_kernels`): built on this machine, equal to the
pure-JAX attention and to a dense reference, used by a CPU runner's decode steps by default."""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_backend import SeqInput, TargetRunner, cpu_kernels
from jax_backend.paged_attention import CPU_KERNEL_MAX_Q_LEN, interleave_kv, prefix_block_attention, ragged_paged_attention
from tests.jax_backend.test_paged_attention import _dense_reference, pack_specs
from tests.tiny_checkpoints import make_tiny_target

PAGE, NUM_PAGES, PAGES_PER_SEQ, HEAD_DIM = 4, 64, 16, 64


@pytest.fixture(autouse=True, scope="module")
def registered_kernels():
    """Every test here calls the kernels: they are built and registered first (also for a test
    selected alone)."""
    assert cpu_kernels.available()


def test_the_kernel_builds_and_registers_here(monkeypatch, tmp_path):
    """CI's machines have a C++ compiler: the kernel must build (here into an empty directory, as
    on a new machine), load and export its handler, or every CPU step loses it."""
    assert cpu_kernels.available()
    monkeypatch.setenv(cpu_kernels.ENV_DIR, str(tmp_path))
    path = cpu_kernels.build()
    assert path.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [path.name]
    assert hasattr(ctypes.CDLL(str(path)), cpu_kernels.TARGET)
    assert cpu_kernels.build() == path  # built once: the second call finds it


def test_a_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setenv(cpu_kernels.ENV_DIR, str(tmp_path))
    with pytest.raises(RuntimeError, match="no C.. compiler .no-such-compiler-xyz."):
        cpu_kernels.build()


def _decode_case(num_q_heads, num_kv_heads, seed=0):
    """Decode and short verify blocks (q_len <= CPU_KERNEL_MAX_Q_LEN) over scattered pages, a
    sequence with no cached prefix, padding sequences with garbage lengths, garbage in the
    scratch page and past every sequence's length."""
    rng = np.random.default_rng(seed)
    specs = [(1, 21), (4, 37), (1, 5), (2, 2), (3, 60), (1, 1)]  # (q_len, kv_len incl. the new tokens)
    max_seqs, num_tokens = 8, 16
    pool = rng.standard_normal((NUM_PAGES, PAGE, 2 * num_kv_heads, HEAD_DIM), np.float32)
    pool[0] = 1e4  # scratch page: never read
    pages = rng.permutation(np.arange(1, NUM_PAGES))
    garbage = rng.integers(0, PAGES_PER_SEQ * PAGE, max_seqs).astype(np.int32)  # padding sequences' lengths
    page_indices, kv_lens, cu_q_lens = pack_specs(specs, pages, garbage, PAGES_PER_SEQ, PAGE)
    for i, (_, kv_len) in enumerate(specs):
        if kv_len % PAGE:  # stale tail of the last page
            pool[page_indices[i, (kv_len - 1) // PAGE], kv_len % PAGE :] = -1e4
    arrays = dict(
        queries=rng.standard_normal((num_tokens, num_q_heads, HEAD_DIM), np.float32),
        kv_pages=pool, kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
        num_seqs=np.array([len(specs)], np.int32),
    )
    return {k: jnp.asarray(v) for k, v in arrays.items()}, specs


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_kernel_attention_equals_the_dense_reference_and_the_jax_path(num_q_heads, num_kv_heads):
    args, specs = _decode_case(num_q_heads, num_kv_heads)
    run = lambda kernel: np.asarray(jax.jit(functools.partial(
        ragged_paged_attention, sm_scale=HEAD_DIM**-0.5, max_q_len=CPU_KERNEL_MAX_Q_LEN, chunk_tokens=16,
        cpu_kernel=kernel))(**args))
    ours, jax_path = run(True), run(False)
    np.testing.assert_allclose(ours, jax_path, atol=2e-6, rtol=0)
    real = int(args["cu_q_lens"][len(specs)])
    assert np.all(ours[real:] == 0)
    pool, queries = np.asarray(args["kv_pages"]), np.asarray(args["queries"])
    for i, (q_len, kv_len) in enumerate(specs):
        strip = pool[np.asarray(args["page_indices"][i])].reshape(-1, 2 * num_kv_heads, HEAD_DIM)
        start = int(args["cu_q_lens"][i])
        expected = _dense_reference(queries[start : start + q_len], strip[:kv_len, 0::2], strip[:kv_len, 1::2],
                                    HEAD_DIM**-0.5)
        np.testing.assert_allclose(ours[start : start + q_len], expected, atol=1e-5, rtol=0)


def test_kernel_prefix_attention_equals_the_jax_path():
    """The model's variant: the kernel reads the cached prefix, the new tokens come as arrays
    (a sequence whose prefix is empty sees only its new tokens)."""
    args, specs = _decode_case(9, 3, seed=1)
    rng = np.random.default_rng(2)
    k, v = (jnp.asarray(rng.standard_normal((16, 3, HEAD_DIM), np.float32)) for _ in range(2))
    rest = {name: value for name, value in args.items() if name != "queries"}
    run = lambda kernel: np.asarray(jax.jit(functools.partial(
        prefix_block_attention, sm_scale=HEAD_DIM**-0.5, max_q_len=CPU_KERNEL_MAX_Q_LEN, chunk_tokens=16,
        loop_to_longest=True, cpu_kernel=kernel))(args["queries"], k, v, **rest))
    np.testing.assert_allclose(run(True), run(False), atol=2e-6, rtol=0)


# (q_len, prefix + q_len); the last two long (700, 1,100 keys: many online-softmax blocks).
WHOLE_STEP_SPECS = [(16, 316), (7, 157), (1, 1), (16, 16), (3, 263), (16, 1100), (1, 700)]


def whole_step_case(num_q_heads, num_kv_heads, head_dim, page=16):
    """Inputs of `prefix_block_attention` (numpy): verify blocks of up to CPU_KERNEL_MAX_Q_LEN
    tokens over prefixes past one 128-key block (several online-softmax steps), a sequence without
    a prefix, stale values at and after each prefix in the pages, padding sequences with garbage
    lengths and padding rows. A `page` size that does not divide 128 starts key blocks mid-page."""
    rng = np.random.default_rng(num_q_heads + head_dim)
    pages_per_seq, max_seqs, num_tokens, num_pages = -(-1152 // page), 8, 64, 200
    specs = WHOLE_STEP_SPECS
    pool = rng.standard_normal((num_pages, page, 2 * num_kv_heads, head_dim), np.float32)
    pool[0] = 1e4  # scratch page: never read
    garbage = rng.integers(0, pages_per_seq * page, max_seqs).astype(np.int32)
    page_indices, kv_lens, cu_q_lens = pack_specs(specs, rng.permutation(np.arange(1, num_pages)), garbage,
                                                  pages_per_seq, page)
    for i, (q_len, kv_len) in enumerate(specs):  # the new tokens' slots hold stale values: never read
        for pos in range(kv_len - q_len, kv_len):
            pool[page_indices[i, pos // page], pos % page] = 1e4
    queries = rng.standard_normal((num_tokens, num_q_heads, head_dim), np.float32)
    new_k, new_v = (rng.standard_normal((num_tokens, num_kv_heads, head_dim), np.float32) for _ in range(2))
    return queries, new_k, new_v, pool, kv_lens, page_indices, cu_q_lens, np.array([len(specs)], np.int32)


@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, page", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 16),
                                                                       (9, 3, 64, 24)])
def test_the_whole_step_attention_equals_the_dense_reference_and_the_jax_path(num_q_heads, num_kv_heads, head_dim, page):
    """`prefix_block_attention` as one kernel call (`cpu_kernels.ragged_attention`) on
    `whole_step_case`, a block's rows split over work units."""
    case = whole_step_case(num_q_heads, num_kv_heads, head_dim, page)
    queries, new_k, new_v, pool, kv_lens, page_indices, cu_q_lens, _ = case
    specs = WHOLE_STEP_SPECS
    args = [jnp.asarray(a) for a in case]
    fn = lambda kernel: jax.jit(functools.partial(  # noqa: E731
        prefix_block_attention, sm_scale=head_dim**-0.5, max_q_len=CPU_KERNEL_MAX_Q_LEN, chunk_tokens=64,
        loop_to_longest=True, cpu_kernel=kernel))
    assert cpu_kernels.RAGGED_TARGET in fn(True).lower(*args).as_text()
    ours, jax_path = np.asarray(fn(True)(*args)), np.asarray(fn(False)(*args))
    np.testing.assert_allclose(ours, jax_path, atol=1e-5, rtol=0)
    assert np.all(ours[cu_q_lens[len(specs)] :] == 0)
    for i, (q_len, kv_len) in enumerate(specs):
        strip = pool[page_indices[i]].reshape(-1, 2 * num_kv_heads, head_dim)[: kv_len - q_len]
        start = cu_q_lens[i]
        keys = np.concatenate([strip[:, 0::2], new_k[start : start + q_len]])
        values = np.concatenate([strip[:, 1::2], new_v[start : start + q_len]])
        expected = _dense_reference(queries[start : start + q_len], keys, values, head_dim**-0.5)
        np.testing.assert_allclose(ours[start : start + q_len], expected, atol=1e-5, rtol=0)


def test_the_kernel_runs_only_where_it_applies():
    """Longer query blocks and bfloat16 pools keep XLA's attention (the kernel is float32, for
    up to CPU_KERNEL_MAX_Q_LEN queries per sequence)."""
    args, _ = _decode_case(9, 3)
    rest = {name: value for name, value in args.items() if name != "queries"}

    def lowered(max_q_len, dtype=jnp.float32):
        fn = functools.partial(ragged_paged_attention, sm_scale=0.125, max_q_len=max_q_len, cpu_kernel=True)
        return jax.jit(fn).lower(args["queries"].astype(dtype), **dict(rest, kv_pages=rest["kv_pages"].astype(dtype)))

    assert cpu_kernels.TARGET in lowered(CPU_KERNEL_MAX_Q_LEN).as_text()
    assert cpu_kernels.TARGET not in lowered(2 * CPU_KERNEL_MAX_Q_LEN).as_text()
    assert cpu_kernels.TARGET not in lowered(CPU_KERNEL_MAX_Q_LEN, jnp.bfloat16).as_text()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("cpu_kernels"), "llama")


def test_a_cpu_runner_decodes_through_the_kernel_with_the_same_tokens(checkpoint):
    """By default a float32 CPU runner's decode steps run the kernel; greedy tokens, logits and
    features equal a runner without it."""
    runners = [TargetRunner(checkpoint, page_size=8, max_total_tokens=1024, max_num_seqs=4, aux_layer_ids=(1,),
                            cpu_attention=flag) for flag in (None, False)]
    assert runners[0].cpu_attention and not runners[1].cpu_attention
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 40, 300)]  # the last past one 256-token chunk
    results = []
    for r in runners:
        tables = [r.allocator.allocate(i, len(p) + 12) for i, p in enumerate(prompts)]
        first = r.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
        tokens = [[int(l[0].argmax())] for l in first.logits]
        features = []
        for step in range(10):
            seqs = [SeqInput([tok[-1]], len(p) + step, t) for p, tok, t in zip(prompts, tokens, tables)]
            out = r.sample(seqs, [0.0] * 3, [1.0] * 3, [0] * 3)
            features.append(np.concatenate([np.asarray(a) for a in out.aux_hidden]))
            for tok, new in zip(tokens, out.tokens):
                tok.append(int(new))
        step_fn = r._sample_steps["greedy"]
        batch, _ = r._batch(seqs)
        greedy = tuple(np.asarray(a) for a in (np.zeros(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.int32)))
        text = step_fn.lower(r._step_params, r.kv_pool, batch, *greedy, None).as_text()
        results.append((tokens, features, cpu_kernels.TARGET in text))
    assert results[0][2] and not results[1][2]
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_cpu_attention_true_where_it_cannot_apply_is_an_error(checkpoint):
    with pytest.raises(ValueError, match="cpu_attention=True needs one CPU device and dtype float32"):
        TargetRunner(checkpoint, dtype="bfloat16", max_total_tokens=64, cpu_attention=True)


def test_a_decode_row_and_the_same_tokens_verify_row_get_the_same_bits():
    """The whole-step kernel gives a token's attention output the same bits as a verify block's
    row and as a decode step's only row (greedy DFLASH == NONE rests on it), at short and long
    contexts: every row runs the same online softmax over the same key blocks whatever its
    neighbours."""
    rng = np.random.default_rng(7)
    heads, kv_heads, dim, page, width, block = 9, 3, 64, 16, 80, 8
    for length in (300, 1100):
        keys, values = (rng.standard_normal((length, kv_heads, dim), np.float32) for _ in range(2))
        queries = rng.standard_normal((block, heads, dim), np.float32)
        pool = np.zeros((width + 1, page, 2 * kv_heads, dim), np.float32)
        pool[1:].reshape(-1, 2 * kv_heads, dim)[:length, 0::2] = keys
        pool[1:].reshape(-1, 2 * kv_heads, dim)[:length, 1::2] = values
        pages = np.arange(1, width + 1, dtype=np.int32)[None]

        def attend(rows: slice) -> np.ndarray:  # tokens `rows` of the last block, new in this step
            n = rows.stop - rows.start
            kv_len, start = np.array([length - block + rows.stop], np.int32), length - block + rows.start
            return np.asarray(cpu_kernels.ragged_attention(
                jnp.asarray(queries[rows]), jnp.asarray(keys[start : start + n]), jnp.asarray(values[start : start + n]),
                jnp.asarray(pool), kv_len, jnp.asarray(pages), np.array([0, n], np.int32), np.array([1], np.int32),
                sm_scale=dim**-0.5, mask_value=-0.7 * float(np.finfo(np.float32).max)))

        verify = attend(slice(0, block))
        for j in range(block):
            assert np.array_equal(attend(slice(j, j + 1))[0], verify[j]), (length, j)
        expected = _dense_reference(queries, keys, values, dim**-0.5)
        np.testing.assert_allclose(verify, expected, atol=1e-5, rtol=0)


def _sdpa(q, k, v, mask, scale):
    """torch's F.scaled_dot_product_attention, the meaning `cpu_kernels.dense_attention` has, in
    float64 (then rounded to float32): torch's own float32 kernel differs by CPU, and on an AMD
    EPYC it was 3.9e-6 from float64 where this kernel was 1.0e-6 (300 keys, head size 128)."""
    import torch
    t = lambda a: None if a is None else torch.from_numpy(np.asarray(a, np.float64 if np.asarray(a).dtype == np.float32 else None))  # noqa: E731
    out = torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask), scale=scale)
    return out.numpy().astype(np.float32)


@pytest.mark.parametrize("n, heads, rows, keys, dim, mask_rows", [
    (1, 3, 24, 520, 64, 1),  # the drafter's block of 8 x 3 query heads per kv head, a 512-row window
    (2, 3, 24, 137, 64, 24),  # a mask per row (causal / sliding-window drafter layers)
    (3, 2, 5, 300, 128, 1),
    (2, 1, 7, 40, 64, None),
])
def test_dense_attention_is_torchs_sdpa(n, heads, rows, keys, dim, mask_rows):
    """The drafter's CPU attention: float32 SDPA with a boolean mask; each row gathers only the
    keys its mask allows, key blocks of 128 with an online softmax (so 520 keys take five)."""
    assert cpu_kernels.available()
    rng = np.random.default_rng(n * keys)
    q, k, v = (rng.standard_normal(shape).astype(np.float32)
               for shape in ((n, heads, rows, dim), (n, heads, keys, dim), (n, heads, keys, dim)))
    mask = None
    if mask_rows is not None:
        mask = rng.random((n, 1, mask_rows, keys)) < 0.6
        mask[..., -3:] = True
    out = jax.jit(functools.partial(cpu_kernels.dense_attention, scale=0.2))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(out), _sdpa(q, k, v, mask, 0.2), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads, rows, block, dim", [(3, 12, 4, 64), (2, 24, 8, 128)])
def test_cache_attention_is_dense_attention_over_the_gathered_window_bit_for_bit(heads, rows, block, dim):
    """The drafter's attention over its cache in place: each sequence's cached rows 0 .. len - 1
    of its slot, then its block, the same keys in the same order as `dense_attention` over the
    window gathered next to the block with a mask: the same bits (lengths 0, past one key block,
    the whole cache; two sequences in one slot)."""
    assert cpu_kernels.available()
    rng = np.random.default_rng(rows)
    slots_total, cached, n = 5, 300, 4
    k_cache, v_cache = (rng.standard_normal((slots_total, heads, cached, dim)).astype(np.float32) for _ in range(2))
    k_block, v_block = (rng.standard_normal((n, heads, block, dim)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((n, heads, rows, dim)).astype(np.float32)
    slots, lens = np.array([4, 0, 2, 4], np.int32), np.array([131, 0, 300, 7], np.int32)
    got = jax.jit(functools.partial(cpu_kernels.cache_attention, scale=0.3))(q, k_cache, v_cache, slots, lens, k_block, v_block)
    keys = np.concatenate([k_cache[slots], k_block], 2)
    values = np.concatenate([v_cache[slots], v_block], 2)
    mask = np.concatenate([np.arange(cached)[None] < lens[:, None], np.ones((n, block), bool)], 1)[:, None, None, :]
    want = cpu_kernels.dense_attention(q, keys, values, mask, scale=0.3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got), _sdpa(q, keys, values, mask, 0.3), atol=2e-6, rtol=1e-5)
    with pytest.raises(Exception, match="a slot or length outside the cache"):
        np.asarray(cpu_kernels.cache_attention(q, k_cache, v_cache, slots, lens + 1, k_block, v_block))


def test_dense_attention_rows_that_see_nothing_are_nan_and_bad_masks_are_refused():
    assert cpu_kernels.available()
    q = np.ones((1, 1, 3, 64), np.float32)
    k = np.arange(10 * 64, dtype=np.float32).reshape(1, 1, 10, 64) / 640
    mask = np.zeros((1, 1, 3, 10), bool)
    mask[:, :, 1:, :4] = True
    out = np.asarray(cpu_kernels.dense_attention(q, k, k, mask))
    assert np.isnan(out[0, 0, 0]).all() and not np.isnan(out[0, 0, 1:]).any()  # as torch: NaN where nothing is seen
    np.testing.assert_allclose(out[0, 0, 1:], _sdpa(q, k, k, mask, None)[0, 0, 1:], rtol=1e-6)
    with pytest.raises(ValueError, match="mask of shape"):
        cpu_kernels.dense_attention(q, k, k, np.ones((1, 2, 3, 10), bool))
