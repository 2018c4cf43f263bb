"""The greedy head (`cpu_kernels.greedy_tokens`, `jax_backend.greedy_head`): each row's token is the
argmax of `rows_matmul`'s float32 logits (the first maximum; the first NaN in a row with one) with
or without AMX tiles, on random, tied, nearly tied and non-finite rows and on SmolLM2's own head;
its tiles hold the weights' int8 codes within the recorded error; a runner's greedy decode and verify steps of 16+ rows
take their tokens from it with the same results as the logits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_backend import SeqInput, TargetRunner, cpu_kernels, greedy_head, sampling, steps
from tests.tiny_checkpoints import make_tiny_target


@pytest.fixture(autouse=True, scope="module")
def kernels():
    assert cpu_kernels.available()


@functools.partial(jax.jit, static_argnames="amx")
def _tokens(x, w, head, amx):
    return cpu_kernels.greedy_tokens(x, w, head, amx)


def _reference(x, w) -> np.ndarray:
    return np.asarray(sampling.argmax(cpu_kernels.rows_matmul(jnp.asarray(x), jnp.asarray(w))))


def _check(x, w, amx_too: bool = True) -> np.ndarray:
    """The kernel's tokens with the plain approximation (and the AMX tiles where they run) against
    the argmax of the float32 logits; returns them."""
    head = greedy_head.pack(jnp.asarray(w))
    want = _reference(x, w)
    for amx in (False, True) if amx_too else (False,):
        np.testing.assert_array_equal(np.asarray(_tokens(jnp.asarray(x), jnp.asarray(w), head, amx)), want)
    return want


@pytest.mark.skipif(not cpu_kernels.vnni_available(), reason="the kernels are built without AVX-512 VNNI here")
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
def test_vnni_sums_take_the_argmax_of_the_float32_logits(monkeypatch, rows):
    """The sums with AVX-512 VNNI (SGL_DFLASH_AMX=0 keeps AMX tiles out where they run): every
    row count (eight at a time and each remainder), outputs whose codes reach -127 and 127 (the
    unsigned bias and its column correction), a row whose logits are all near zero."""
    monkeypatch.setenv(cpu_kernels.ENV_AMX, "0")
    rng = np.random.default_rng(rows)
    w = rng.normal(0, 0.05, (2048, 192)).astype(np.float32)
    w[5] = np.abs(w[5])  # every code positive: the column sum is at its largest
    w[6] = -np.abs(w[6])
    x = rng.normal(0, 1, (rows, 192)).astype(np.float32)
    x[:, 7] *= 30
    x[-1] *= 1e-30
    head = greedy_head.pack(jnp.asarray(w))
    tokens = jax.jit(lambda x: cpu_kernels.greedy_tokens(x, jnp.asarray(w), head))(jnp.asarray(x))  # traced here
    np.testing.assert_array_equal(np.asarray(tokens), _reference(x, w))
    x[:, :] = np.abs(x) * (w[5] > 0)  # row dot w[5] largest: the column-corrected sum decides
    np.testing.assert_array_equal(np.asarray(cpu_kernels.greedy_tokens(jnp.asarray(x), jnp.asarray(w), head)),
                                  _reference(x, w))


@pytest.mark.parametrize("rows,vocab,k", [(1, 256, 64), (3, 512, 192), (16, 1024, 576), (17, 4096, 128),
                                          (33, 2048, 64), (64, 1024, 320)])
def test_tokens_are_the_argmax_of_the_float32_logits(rows, vocab, k):
    rng = np.random.default_rng(rows)
    w = rng.normal(0, 0.05, (vocab, k)).astype(np.float32)
    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    x[:, 3] *= 25  # an outlier channel, as final hidden states have
    x[0] *= 1e-30  # logits near zero: every output a candidate
    _check(x, w)


def test_rows_with_a_huge_outlier_and_outputs_of_mixed_scales():
    """One channel 1000x the others (the int8 parts of x must still resolve the rest) and outputs
    whose weights span 1e-3 to 10 (one scale per output)."""
    rng = np.random.default_rng(9)
    w = rng.normal(0, 1, (2048, 128)).astype(np.float32) * np.logspace(-3, 1, 2048)[:, None].astype(np.float32)
    x = rng.normal(0, 1, (24, 128)).astype(np.float32)
    x[:, 5] *= 1000
    x[:12, 5] = 0  # half the rows without it
    _check(x, w)


def test_ties_take_the_lowest_index_and_near_ties_the_exact_logit():
    rng = np.random.default_rng(1)
    vocab, k = 512, 64
    w = rng.normal(0, 0.05, (vocab, k)).astype(np.float32)
    x = rng.normal(0, 1, (20, k)).astype(np.float32)
    top = _reference(x, w)
    # Copies of each row's top weights later in the vocabulary: equal logits, the first wins.
    w[vocab - 16 :] = w[top[:16]]
    assert (_check(x, w) == _reference(x, w)).all()
    # Rows of weights with the same int8 codes whose exact logits differ in the last bits: only the
    # exact logits tell them apart.
    w2 = w.copy()
    for i, t in enumerate(top[:16]):
        w2[vocab - 16 + i] = np.nextafter(w[t], np.inf * np.sign(x[i])).astype(np.float32)
    codes, codes2 = (np.asarray(greedy_head.pack(jnp.asarray(a)).packed) for a in (w, w2))
    assert (codes == codes2).mean() > 0.99
    want = _check(x, w2)
    assert (want[:16] == np.arange(vocab - 16, vocab)).sum() >= 8  # the nudged copies win
    _check(np.zeros((4, k), np.float32), w)  # all logits 0: token 0


def test_non_finite_rows_take_the_first_nan_or_the_largest_logit():
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.05, (256, 64)).astype(np.float32)
    x = rng.normal(0, 1, (5, 64)).astype(np.float32)
    x[0, 7] = np.nan
    x[1, 5] = np.inf
    x[2, 9] = -np.inf
    x[3] *= 3e37  # finite, but the logits overflow
    got = _check(x, w)
    assert got[0] == 0  # every logit NaN


def test_the_tiles_hold_the_weights_int8_codes_within_the_recorded_error():
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (48, 192)).astype(np.float32)
    w[5] = 0  # an all-zero output: scale 0, codes 0
    head = greedy_head.pack(jnp.asarray(w))
    packed, scale = np.asarray(head.packed), np.asarray(head.scale)
    assert packed.shape == (3, 3, 1024) and packed.dtype == np.int8
    np.testing.assert_array_equal(np.asarray(head.row_max), np.abs(w).max(1))
    np.testing.assert_allclose(scale, np.abs(w).max(1) / np.float32(127), rtol=3e-7)  # XLA: x * (1/127)
    codes = packed.reshape(3, 3, 16, 16, 4).transpose(0, 3, 1, 2, 4).reshape(48, 192)  # [g, n, c, i, t]
    for g, c, i, n, t in [(0, 0, 0, 0, 0), (2, 1, 7, 13, 1), (1, 2, 15, 15, 3), (2, 2, 3, 0, 2)]:
        assert packed[g, c, i * 64 + n * 4 + t] == codes[16 * g + n, 64 * c + 4 * i + t]
    assert np.abs(codes.astype(np.int32)).max() == 127 and not codes[5].any()
    error = np.abs(w.astype(np.float64) - scale[:, None].astype(np.float64) * codes).max(1)
    assert (error <= np.asarray(head.row_err)).all() and (np.asarray(head.row_err) <= scale * 0.51).all()


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match="lm_head of shape .V % 16 == 0, K % 64 == 0., got float32 .100, 64."):
        greedy_head.attach({"lm_head": jnp.zeros((100, 64))}, True, cpu_matmul=True)
    w = jnp.zeros((256, 64))
    with pytest.raises(Exception, match="R <= 64"):
        _tokens(jnp.zeros((65, 64)), w, greedy_head.pack(w), True)


@pytest.mark.slow  # the real model (imported once into cache/models)
def test_smollm2_head_on_hidden_like_rows():
    """SmolLM2's 49,152 x 576 head (its float32 weights, as the runner holds them) on 32 rows with
    the statistics of final hidden states (an outlier channel), against the float32 logits of the
    GGUF blocks the serving steps read."""
    from sgl_dflash.tools.model_import import ensure_default_model

    runner = TargetRunner(str(ensure_default_model()), max_total_tokens=64, greedy_head=False)
    w, blocks = runner.params["lm_head"], runner.params["blocks"]["lm_head"]
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (32, 576)).astype(np.float32)
    x[:, rng.integers(0, 576, 3)] *= 20
    want = np.asarray(sampling.argmax(cpu_kernels.rows_matmul_blocks(jnp.asarray(x), blocks)))
    got = np.asarray(_tokens(jnp.asarray(x), w, greedy_head.pack(w), True))
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("greedy_head"), "llama")


def test_runner_greedy_steps_take_the_same_tokens_from_the_head(checkpoint):
    """A runner with the head (True: here without AMX too) against one without: a decode step of 16
    sequences and a verify of 4 blocks of 4 (16 logit rows) give the same tokens, accept counts and
    bonus tokens; the head's programs call the kernel at 16 rows and at 4, the other runner's never."""
    make = functools.partial(TargetRunner, checkpoint, page_size=8, max_total_tokens=2048, max_num_seqs=16,
                             aux_layer_ids=(1,))
    runners = [make(greedy_head=True), make(greedy_head=False)]
    assert "greedy_head" in runners[0].params and "greedy_head" not in runners[1].params
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(5, 40, 16)]
    drafts = rng.integers(0, 256, (4, 3))
    results = []
    for r in runners:
        tables = [r.allocator.allocate(i, len(p) + 8) for i, p in enumerate(prompts)]
        r.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
        decode = r.sample([SeqInput([p[-1]], len(p), t) for p, t in zip(prompts, tables)], [0.0] * 16, [1.0] * 16, [0] * 16)
        verify = r.verify([SeqInput([int(decode.tokens[i]), *drafts[i].tolist()], len(prompts[i]) + 1, tables[i], "all")
                           for i in range(4)])
        results.append((np.asarray(decode.tokens), np.asarray(verify.accepted), np.asarray(verify.bonus)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)

    def lowered(runner, n):
        batch, _ = runner._batch([SeqInput([1], 4, [i + 1]) for i in range(n)])
        greedy = (np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32))
        sample = runner._jitted(runner._sample_steps, "greedy", steps.sample_step)
        return sample.lower(runner._step_params, runner.kv_pool, batch, *greedy, None).as_text()

    assert cpu_kernels.GREEDY_TARGET in lowered(runners[0], 16)
    assert cpu_kernels.GREEDY_TARGET in lowered(runners[0], 4)
    assert cpu_kernels.GREEDY_TARGET not in lowered(runners[1], 4)
    assert cpu_kernels.GREEDY_TARGET not in lowered(runners[1], 16)


def test_the_default_follows_the_fast_sums(checkpoint):
    runner = TargetRunner(checkpoint, page_size=8, max_total_tokens=256)
    assert ("greedy_head" in runner.params) == (cpu_kernels.amx_available() or cpu_kernels.vnni_available())
    with pytest.raises(ValueError, match="greedy_head=True needs the CPU matmul kernel"):
        TargetRunner(checkpoint, page_size=8, max_total_tokens=256, cpu_matmul=False, greedy_head=True)
