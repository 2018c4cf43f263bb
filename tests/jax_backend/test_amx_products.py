"""Q4_1 products on AMX tiles (`blocks.TiledQ4`, `cpu_kernels.rows_matmul_blocks` on AMX hosts,
docs/performance.md section 54): the tile order holds the blocks' codes and scales; the tiles and
their emulation without tiles (steps of 1-2 rows) give the same bits, so a row's products do not depend
on the rows beside it or on the step; sums within float32 accumulation of the exact values; a
runner's verify block accepts what its one-row decode steps chose, as
the float32 runner's tokens. And the drafter's bfloat16 weights on AMX tiles
(`rows_matmul(bf16_tiled=True)`, section 55): their tile order, float32-accurate sums, a row's bits
alone as among others."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_backend import SeqInput, TargetRunner, blocks, cpu_kernels
from tests.jax_backend.test_gguf_blocks import quantize_checkpoint, random_blocks
from tests.tiny_checkpoints import make_tiny_target

amx = pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.amx_products()),
                         reason="this CPU (or build) has no AMX tiles: its Q4_1 products stay on the FMA kernel")


def test_the_tile_order_holds_the_codes_and_scales():
    rng = np.random.default_rng(0)
    b = random_blocks(rng, (2, 32, 96), "Q4_1")
    t = blocks.tile_q4(b)
    assert t.codes.shape == b.codes.shape and t.scale.shape == b.scale.shape
    q = blocks.dequantize(blocks.BlockWeights(b.codes, np.ones_like(b.scale), np.zeros_like(b.offset)))  # the codes
    codes = np.asarray(t.codes).reshape(2, 2, 3, 16, 16)  # [L, group, block, pair-row, output]
    for layer, g, blk, i, n in [(0, 0, 0, 0, 0), (1, 1, 2, 15, 15), (0, 1, 1, 7, 3), (1, 0, 2, 9, 12)]:
        byte = codes[layer, g, blk, i, n]
        assert byte & 15 == q[layer, 16 * g + n, 32 * blk + 2 * i] and byte >> 4 == q[layer, 16 * g + n, 32 * blk + 2 * i + 1]
        assert np.asarray(t.scale).reshape(2, 2, 3, 16)[layer, g, blk, n] == b.scale[layer, 16 * g + n, blk]
        assert np.asarray(t.offset).reshape(2, 2, 3, 16)[layer, g, blk, n] == b.offset[layer, 16 * g + n, blk]


@amx
# (3-16 rows: `groups_few_rows`, its output groups taken 3, 2 and 1 at a time: 5 x 960, 3 x 512, 8 x 80)
@pytest.mark.parametrize("rows,k,n", [(1, 576, 3072), (2, 64, 16), (3, 576, 512), (5, 576, 960), (8, 576, 80),
                                      (16, 1536, 576), (17, 96, 48), (33, 128, 32), (64, 576, 64)])
def test_tiles_and_their_emulation_give_the_same_bits(rows, k, n):
    rng = np.random.default_rng(rows * 7 + k)
    stack = random_blocks(rng, (2, n, k), "Q4_1")
    tiled = blocks.tile_q4(stack)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, 3] *= 30  # an outlier channel
    x[0, 5:9] = [1e-30, -3e-41, 0.0, 6e4]  # tiny, subnormal, zero and large elements
    run = lambda path, xs: np.asarray(jax.jit(functools.partial(cpu_kernels.rows_matmul_blocks, tiled_path=path))(xs, tiled, 1))  # noqa: E731
    got = run("tiles", x)
    np.testing.assert_array_equal(run("emulated", x), got)
    np.testing.assert_array_equal(run("auto", x), got)
    for i in range(min(rows, 4)):  # a row alone (emulated) = the same row among the others (tiles)
        np.testing.assert_array_equal(run("auto", x[i : i + 1])[0], got[i])
    w = blocks.dequantize(stack)[1].astype(np.float64)
    exact, size = x.astype(np.float64) @ w.T, np.abs(x.astype(np.float64)) @ np.abs(w).T
    assert (np.abs(got - exact) <= 4 * k * 2.0**-24 * size + 1e-30).all()  # float32 accumulation's bound
    assert np.abs(got - exact).max() / size.max() < 1e-6


@amx
def test_bad_tiled_inputs_are_errors():
    rng = np.random.default_rng(1)
    tiled = blocks.tile_q4(random_blocks(rng, (32, 64), "Q4_1"))
    with pytest.raises(Exception, match="at most 64 rows"):
        np.asarray(cpu_kernels.rows_matmul_blocks(np.zeros((65, 64), np.float32), tiled))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    directory = make_tiny_target(tmp_path_factory.mktemp("amx_products"), "llama", hidden_size=64, intermediate_size=128)
    quantize_checkpoint(directory)
    return directory


@amx
def test_a_verify_block_accepts_what_one_row_decode_steps_chose(quantized):
    """Greedy DFLASH == greedy NONE at the runner: 7 one-row decode steps (the emulation) of a
    sequence, then the same tokens as one verify block (the tiles) accept every draft and give the
    next decoded token as the bonus; the float32 runner decodes the same tokens."""
    make = functools.partial(TargetRunner, quantized, page_size=8, max_total_tokens=256, max_num_seqs=2, aux_layer_ids=(1,))
    runner, plain = make(), make(gguf_blocks=False)
    assert any(isinstance(b, blocks.TiledQ4) for b in runner.params["blocks"].values())
    prompts = [np.random.default_rng(seed).integers(0, 256, 9 + seed).tolist() for seed in range(3)]

    def decode(r, prompt, steps=8):
        table = r.allocator.allocate(0, 32)
        tokens = [int(np.asarray(r.forward([SeqInput(prompt, 0, table)]).logits[0])[-1].argmax())]
        for step in range(steps):
            out = r.sample([SeqInput([tokens[-1]], len(prompt) + step, table)], [0.0], [1.0], [0])
            tokens.append(int(out.tokens[0]))
        verify = r.verify([SeqInput(tokens[:7], len(prompt), table, "all")])
        r.allocator.free(0)
        return tokens, int(np.asarray(verify.accepted)[0]), int(np.asarray(verify.bonus)[0])

    for prompt in prompts:
        tokens, accepted, bonus = decode(runner, prompt)
        assert (accepted, bonus) == (6, tokens[7])
        assert decode(plain, prompt)[0] == tokens


def test_the_bf16_tile_order_holds_the_weights_as_the_kernel_reads_them():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((2, 48, 96)), jnp.bfloat16)
    t = np.asarray(cpu_kernels.bf16_tile_order(w).astype(jnp.float32))
    assert t.shape == w.shape and sorted(t.ravel()) == sorted(np.asarray(w.astype(jnp.float32)).ravel())
    tiles = t.reshape(2, 3, 3, 16, 16, 2)  # [L, group, block, pair-row, output, pair]
    for layer, g, blk, i, n, j in [(0, 0, 0, 0, 0, 0), (1, 2, 2, 15, 15, 1), (0, 1, 1, 7, 3, 0), (1, 0, 2, 9, 12, 1)]:
        assert tiles[layer, g, blk, i, n, j] == float(w[layer, 16 * g + n, 32 * blk + 2 * i + j])
    with pytest.raises(ValueError, match="N % 16 == 0"):
        cpu_kernels.bf16_tile_order(jnp.zeros((40, 64), jnp.bfloat16))


@amx
@pytest.mark.parametrize("rows,k,n", [(1, 576, 576), (2, 64, 16), (7, 2880, 576), (8, 576, 1536), (16, 1536, 576),
                                      (17, 96, 48), (33, 128, 32), (64, 576, 192)])
def test_bf16_weights_on_tiles_sum_to_float32_accuracy_and_a_rows_bits_stand_alone(rows, k, n):
    """`rows_matmul(bf16_tiled=True)` (the drafter's bf16 weights on AMX): within float32
    accumulation's bound of the exact sums; a row alone gets the bits it gets among 1-64 others."""
    rng = np.random.default_rng(rows * 5 + n)
    w = jnp.asarray(0.05 * rng.standard_normal((2, n, k)), jnp.bfloat16)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, 3] *= 30  # an outlier channel
    x[0, 5:9] = [1e-30, -3e-41, 0.0, 6e4]  # tiny, subnormal, zero and large elements
    run = jax.jit(functools.partial(cpu_kernels.rows_matmul, bf16_tiled=True))
    tiled = cpu_kernels.bf16_tile_order(w)
    got = np.asarray(run(x, tiled, 1))
    for i in sorted({0, rows // 2, rows - 1}):
        np.testing.assert_array_equal(np.asarray(run(x[i : i + 1], tiled, 1))[0], got[i])
        np.testing.assert_array_equal(np.asarray(run(np.concatenate([x[i : i + 1]] * 20), tiled, 1))[19], got[i])
    wf = np.asarray(w[1].astype(jnp.float32), np.float64)
    exact, size = x.astype(np.float64) @ wf.T, np.abs(x.astype(np.float64)) @ np.abs(wf).T
    assert (np.abs(got - exact) <= 4 * k * 2.0**-24 * size + 1e-30).all()  # float32 accumulation's bound
    with pytest.raises(ValueError, match="at most 64 rows"):
        cpu_kernels.rows_matmul(np.zeros((65, k), np.float32), tiled, 1, bf16_tiled=True)
