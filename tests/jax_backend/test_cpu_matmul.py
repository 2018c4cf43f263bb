"""The CPU matmul kernel (`cpu_kernels.rows_matmul`): equal to a float64 reference, the same bits
for a row whatever the rows beside it, reading a layer stack in place, and used by a CPU runner's
decode and verify steps by default with the same greedy tokens as XLA's dots."""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_backend import SeqInput, TargetRunner, cpu_kernels, model, steps
from tests.tiny_checkpoints import make_tiny_target


def test_the_library_exports_the_matmul_handler():
    assert cpu_kernels.available()
    assert hasattr(ctypes.CDLL(str(cpu_kernels.build())), cpu_kernels.MATMUL_TARGET)


# (rows, K, N): every remainder of the 4-row tiles, of the 6-output tiles and of a single row's
# 8-output tiles, the 13-16 row 6 x 4 tiles (and their remainders), K not a multiple of 16, widths
# past one thread's chunk, SmolLM2's projection shapes.
SHAPES = [(1, 576, 576), (1, 40, 13), (2, 576, 192), (3, 1536, 576), (4, 100, 37), (5, 64, 11), (7, 33, 9),
          (8, 576, 1536), (13, 100, 37), (16, 576, 1536), (17, 64, 130), (64, 576, 1000), (70, 48, 24)]


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_rows_matmul_equals_a_float64_reference(rows, k, n):
    rng = np.random.default_rng(rows * 1000 + k)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    stack = rng.standard_normal((3, n, k), dtype=np.float32)
    got = np.asarray(jax.jit(cpu_kernels.rows_matmul)(x, stack, 2))
    want = x.astype(np.float64) @ stack[2].T.astype(np.float64)
    np.testing.assert_allclose(got, want, atol=2e-5 * np.sqrt(k), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.rows_matmul(x, stack[2])), got)  # one layer = the stack's


def test_a_row_gets_the_same_bits_alone_as_in_any_block():
    """A verify block's rows and a decode step's single row are the same sums in the same order:
    a greedy verify accepts exactly what greedy decoding would emit."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((23, 576), dtype=np.float32)
    w = rng.standard_normal((1000, 576), dtype=np.float32)
    block = np.asarray(cpu_kernels.rows_matmul(x, w))
    for start, size in [(0, 1), (5, 1), (0, 2), (3, 4), (9, 8), (2, 12), (1, 13), (7, 16), (0, 23)]:
        np.testing.assert_array_equal(np.asarray(cpu_kernels.rows_matmul(x[start : start + size], w)),
                                      block[start : start + size])


def _lowered_project(rows: int, stacked: bool) -> str:
    stack = jnp.zeros((4, 96, 64), jnp.float32)
    x = jnp.zeros((rows, 64), jnp.float32)
    if stacked:
        fn = lambda s, x, i: model.project({"o_proj_t": s}, x, "o_proj", cpu_kernel=True, layer=i)
        return jax.jit(fn).lower(stack, x, 1).as_text()
    return jax.jit(lambda w, x: model.project({"o_proj_t": w}, x, "o_proj", cpu_kernel=True)).lower(stack[0], x).as_text()


def test_project_runs_the_kernel_only_where_it_applies():
    """Up to CPU_MATMUL_MAX_ROWS float32 rows; prefill chunks and bfloat16 keep XLA's dot. With a
    layer index the kernel's operand is the whole stack (no slice of it to copy)."""
    limit = model.CPU_MATMUL_MAX_ROWS
    assert cpu_kernels.MATMUL_TARGET in _lowered_project(limit, stacked=False)
    assert cpu_kernels.MATMUL_TARGET not in _lowered_project(limit + 1, stacked=False)
    text = _lowered_project(8, stacked=True)
    assert cpu_kernels.MATMUL_TARGET in text and "dynamic_slice" not in text
    assert "tensor<4x96x64xf32>" in text.split(cpu_kernels.MATMUL_TARGET)[1].split("\n")[0]
    assert "dynamic_slice" in _lowered_project(limit + 1, stacked=True)  # XLA's dot reads its layer's slice
    bf16 = jax.jit(lambda w, x: model.project({"o_proj_t": w}, x, "o_proj", cpu_kernel=True)).lower(
        jnp.zeros((96, 64), jnp.bfloat16), jnp.zeros((4, 64), jnp.bfloat16)).as_text()
    assert cpu_kernels.MATMUL_TARGET not in bf16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("cpu_matmul"), "llama")


def _greedy_run(runner: TargetRunner, prompts, steps: int = 8, block: int = 4):
    """Prefill, `steps` greedy decode steps, then one verify block of `block` tokens per sequence
    (the decoded tokens again): tokens, the verify's accepted tokens, logits and features."""
    tables = [runner.allocator.allocate(i, len(p) + steps + block + 2) for i, p in enumerate(prompts)]
    first = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    tokens = [[int(l[0].argmax())] for l in first.logits]
    features = []
    n = len(prompts)
    for step in range(steps):
        seqs = [SeqInput([tok[-1]], len(p) + step, t) for p, tok, t in zip(prompts, tokens, tables)]
        out = runner.sample(seqs, [0.0] * n, [1.0] * n, [0] * n)
        features.append(np.concatenate([np.asarray(a) for a in out.aux_hidden]))
        for tok, new in zip(tokens, out.tokens):
            tok.append(int(new))
    start = [len(p) + steps for p in prompts]
    blocks = [SeqInput(tok[-block:], s, t, logits="all") for tok, s, t in zip(tokens, start, tables)]
    logits = runner.forward(blocks).logits
    for i in range(n):
        runner.allocator.free(i)
    return tokens, features, logits


@pytest.mark.parametrize("layer_loop", ["scan", "switch", "unrolled"])
def test_a_cpu_runner_steps_through_the_kernel_with_the_same_tokens(checkpoint, layer_loop):
    """By default a float32 CPU runner's decode and verify steps run the matmul kernel in every
    layer loop; greedy tokens equal a runner on XLA's dots, logits and features within 1e-4."""
    make = functools.partial(TargetRunner, checkpoint, page_size=8, max_total_tokens=1024, max_num_seqs=4,
                             aux_layer_ids=(1,), layer_loop=layer_loop)
    runners = [make(), make(cpu_matmul=False)]
    assert runners[0].cpu_matmul and not runners[1].cpu_matmul
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 30, 90)]  # the last prefills past 64 rows
    (tok_k, feat_k, logits_k), (tok_x, feat_x, logits_x) = (_greedy_run(r, prompts) for r in runners)
    assert tok_k == tok_x
    for a, b in [*zip(feat_k, feat_x), *zip(logits_k, logits_x)]:
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    seqs = [SeqInput([1], 4, [1])]
    batch, _ = runners[0]._batch(seqs)
    greedy = (np.zeros(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32))
    sample = runners[0]._jitted(runners[0]._sample_steps, "greedy", steps.sample_step)
    text = sample.lower(runners[0]._step_params, runners[0].kv_pool, batch, *greedy, None).as_text()
    assert cpu_kernels.MATMUL_TARGET in text


def test_cpu_matmul_true_where_it_cannot_apply_is_an_error(checkpoint):
    with pytest.raises(ValueError, match="cpu_matmul=True needs one CPU device and dtype float32"):
        TargetRunner(checkpoint, dtype="bfloat16", max_total_tokens=64, cpu_matmul=True)


@pytest.mark.parametrize("rows,k,n", [(1, 64, 40), (3, 128, 7), (8, 576, 300), (13, 96, 33), (16, 96, 33),
                                      (17, 576, 70), (32, 576, 192), (40, 64, 5)])
def test_rows_matmul_reads_bfloat16_weights_as_their_float32_values(rows, k, n):
    """bfloat16 weights (a bf16 drafter checkpoint's) are read as their exact float32 values: up to 16
    rows decoded in registers, past 16 into scratch for the float32 tiles; either way the bits of the
    float32 weights'."""
    assert cpu_kernels.available()
    rng = np.random.default_rng(rows + k)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = jnp.asarray(rng.standard_normal((2, n, k), dtype=np.float32)).astype(jnp.bfloat16)
    got = np.asarray(jax.jit(cpu_kernels.rows_matmul)(x, w, 1))
    np.testing.assert_array_equal(got, np.asarray(cpu_kernels.rows_matmul(x, w[1].astype(jnp.float32))))
    np.testing.assert_array_equal(np.asarray(cpu_kernels.rows_matmul(x, w[1])), got)
