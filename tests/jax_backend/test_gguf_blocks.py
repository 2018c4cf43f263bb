"""Weights kept as GGUF blocks (`jax_backend.blocks`, `cpu_kernels.rows_matmul_blocks`): the kernel
gives exactly `rows_matmul`'s bits for the decoded float32 weights, a runner that reads blocks
computes the same logits bit for bit as one that reads the float32 rows (within 1e-4 on AMX hosts,
whose Q4_1 stacks sum on tiles: test_amx_products), and a blocks file that does not decode to the
checkpoint's weights is never used."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jax_backend import SeqInput, TargetRunner, blocks, cpu_kernels, loader, model, steps
from jax_backend.blocks import BlockWeights
from tests.jax_backend.test_cpu_matmul import _greedy_run
from tests.tiny_checkpoints import make_tiny_target


@pytest.fixture(autouse=True, scope="module")
def kernels():
    assert cpu_kernels.available()


def random_blocks(rng, shape: tuple[int, ...], kind: str) -> BlockWeights:
    """Blocks like a GGUF file's: float16 scales (and offsets), codes over their whole range."""
    *lead, n, k = shape
    scale = (rng.standard_normal((*lead, n, k // 32)) * 0.02).astype(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return BlockWeights(rng.integers(0, 256, (*lead, n, k), dtype=np.uint8), scale)
    offset = (rng.standard_normal((*lead, n, k // 32)) * 0.1).astype(np.float16).astype(np.float32)
    return BlockWeights(rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8), scale, offset)


# (rows, K, N): every row count of a register tile (1-8), more rows in tiles of 8 and a remainder
# (9, 12, 15, 16, 17, 25, 33, 37, 64; weights are decoded in cache from 24 rows on AVX-512, from 32
# rows where K < 1024 on AVX2), odd and even output counts, widths past one thread's chunk and
# SmolLM2's shapes.
SHAPES = [(1, 576, 1536), (1, 64, 13), (2, 1536, 576), (3, 96, 37), (4, 576, 192), (5, 64, 11), (6, 128, 40),
          (7, 32, 9), (8, 576, 576), (9, 64, 50), (12, 192, 33), (15, 64, 7), (16, 576, 130), (17, 64, 24),
          (25, 64, 9), (33, 128, 71), (37, 1024, 21), (64, 64, 20)]


@pytest.mark.parametrize("kind", blocks.KINDS)
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_rows_matmul_blocks_is_rows_matmul_of_the_decoded_weights(rows, k, n, kind):
    rng = np.random.default_rng(rows * 1000 + k + n)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    stack = random_blocks(rng, (3, n, k), kind)
    decoded = blocks.dequantize(stack)
    got = np.asarray(jax.jit(cpu_kernels.rows_matmul_blocks)(x, stack, 2))
    np.testing.assert_array_equal(got, np.asarray(cpu_kernels.rows_matmul(x, decoded[2])))
    one = BlockWeights(*(None if a is None else a[2] for a in stack))  # one layer = the stack's
    np.testing.assert_array_equal(np.asarray(cpu_kernels.rows_matmul_blocks(x, one)), got)


@pytest.mark.parametrize("kind", blocks.KINDS)
def test_a_row_gets_the_same_bits_alone_as_in_any_block(kind):
    """Few rows decode weights in registers, more (24 on AVX-512, 32 on AVX2 at this K) into
    scratch for float32 tiles: a row's products are the same bits either way."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 576), dtype=np.float32)
    w = random_blocks(rng, (700, 576), kind)
    block = np.asarray(cpu_kernels.rows_matmul_blocks(x, w))
    for start, size in [(0, 1), (5, 1), (0, 2), (3, 4), (9, 8), (2, 12), (7, 16), (0, 23), (1, 9), (16, 24),
                        (3, 32), (0, 40)]:
        np.testing.assert_array_equal(np.asarray(cpu_kernels.rows_matmul_blocks(x[start : start + size], w)),
                                      block[start : start + size])


def test_gguf_bytes_decode_like_the_gguf_package():
    """`from_gguf` + `dequantize` against gguf's own dequantization of the same raw blocks."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(2)
    for kind, size in (("Q4_1", 20), ("Q8_0", 34)):
        raw = rng.integers(0, 256, (6, 4 * size), dtype=np.uint8)
        raw.reshape(6, 4, size)[..., 1] &= 0x3B  # float16 scales (and offsets) finite and modest
        if kind == "Q4_1":
            raw.reshape(6, 4, size)[..., 3] &= 0x3B
        want = quants.dequantize(raw, GGMLQuantizationType[kind])
        got = blocks.dequantize(blocks.from_gguf(raw, kind))
        np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_project_reads_blocks_only_for_few_row_kernel_steps():
    rng = np.random.default_rng(3)
    stack = random_blocks(rng, (4, 96, 64), "Q4_1")
    weights = {"o_proj_t": jnp.asarray(blocks.dequantize(stack))}
    stack = BlockWeights(*(jnp.asarray(a) for a in stack))

    def lowered(rows):
        fn = lambda w, b, x, i: model.project(w, x, "o_proj", cpu_kernel=True, layer=i, blocks={"o_proj": b}, index=i)
        return jax.jit(fn).lower(weights, stack, jnp.zeros((rows, 64), jnp.float32), 1).as_text()

    assert cpu_kernels.BLOCKS_TARGET in lowered(model.BLOCKS_MAX_ROWS)
    wider = lowered(model.BLOCKS_MAX_ROWS + 1)  # the float32 weights: the kernel's or XLA's dot
    assert cpu_kernels.BLOCKS_TARGET not in wider
    assert (cpu_kernels.MATMUL_TARGET in wider) == (model.BLOCKS_MAX_ROWS < model.CPU_MATMUL_MAX_ROWS)


def test_bad_block_shapes_are_clear_errors():
    x = jnp.zeros((2, 64), jnp.float32)
    bad = BlockWeights(jnp.zeros((1, 8, 30), jnp.uint8), jnp.zeros((1, 8, 2), jnp.float32), jnp.zeros((1, 8, 2), jnp.float32))
    with pytest.raises(Exception, match="rows_matmul_blocks"):
        jax.block_until_ready(cpu_kernels.rows_matmul_blocks(x, bad, 0))


# -- a checkpoint with blocks ---------------------------------------------------------------------
def quantize_checkpoint(directory: str, seed: int = 0) -> dict[str, BlockWeights]:
    """Replace the tiny checkpoint's projections (and tied embedding) with decoded random blocks
    and write the blocks file beside them, as `sgl_dflash.model_import` does for a GGUF."""
    rng = np.random.default_rng(seed)
    path = f"{directory}/model.safetensors"
    tensors = load_file(path)
    kept = {}
    for name, w in tensors.items():
        if w.ndim == 2 and (name.endswith("_proj.weight") or name == "model.embed_tokens.weight"):
            kind = "Q8_0" if "embed" in name else "Q4_1"
            found = random_blocks(rng, w.shape, kind)
            tensors[name] = blocks.dequantize(found)
            kept[name] = found
    save_file(tensors, path, metadata={"format": "pt"})
    blocks.save_blocks(f"{directory}/{blocks.BLOCKS_FILE}", kept)
    return kept


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    directory = make_tiny_target(tmp_path_factory.mktemp("gguf_blocks"), "llama")
    quantize_checkpoint(directory)
    return directory


@pytest.mark.parametrize("layer_loop", ["scan", "switch", "unrolled"])
def test_a_runner_reading_blocks_gets_the_float32_runners_bits(quantized, layer_loop):
    make = functools.partial(TargetRunner, quantized, page_size=8, max_total_tokens=1024, max_num_seqs=4,
                             aux_layer_ids=(1,), layer_loop=layer_loop)
    with_blocks, without = make(), make(gguf_blocks=False)
    # q/k/v and gate/up read as one fused stack each (`loader.fuse_block_stacks`)
    assert sorted(with_blocks.params["blocks"]) == ["down_proj", "gate_up_proj", "lm_head", "o_proj", "qkv_proj"]
    assert "blocks" not in without.params
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 30)]
    # Greedy decode steps, then a verify block of 4 rows per sequence (8 rows: the blocks' kernel).
    (tok_b, _, logits_b), (tok_f, _, logits_f) = (_greedy_run(runner, prompts, steps=6) for runner in (with_blocks, without))
    assert tok_b == tok_f
    # On AMX hosts the Q4_1 stacks sum per block on the tiles (`blocks.TiledQ4`, test_amx_products):
    # float32-accurate, not the same bits.
    tiled = any(isinstance(b, blocks.TiledQ4) for b in with_blocks.params["blocks"].values())
    assert tiled == cpu_kernels.amx_products()
    for a, b in zip(logits_b, logits_f):
        if tiled:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)  # the target's 1e-4 (transformers)
        else:
            np.testing.assert_array_equal(a, b)
    batch, _ = with_blocks._batch([SeqInput([1], 4, [1])])
    greedy = (np.zeros(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32))
    sample = with_blocks._jitted(with_blocks._sample_steps, "greedy", steps.sample_step)
    text = sample.lower(with_blocks._step_params, with_blocks.kv_pool, batch, *greedy, None).as_text()
    config = with_blocks.config
    fused_width = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    calls = [line for line in text.splitlines() if cpu_kernels.BLOCKS_TARGET in line]
    assert any(f"x{fused_width}xf32>" in line for line in calls)  # q/k/v in one call
    assert any(f"x{2 * config.intermediate_size}xf32>" in line for line in calls)  # gate/up in one


def test_blocks_that_do_not_decode_to_the_weights_are_not_used(tmp_path):
    directory = make_tiny_target(tmp_path, "llama")
    kept = quantize_checkpoint(directory)
    name = "model.layers.2.mlp.up_proj.weight"
    stale = kept[name]._replace(scale=kept[name].scale * 2)  # e.g. a blocks file from another export
    blocks.save_blocks(f"{directory}/{blocks.BLOCKS_FILE}", {**kept, name: stale})
    runner = TargetRunner(directory, page_size=8, max_total_tokens=256, max_num_seqs=2)
    # one layer's stale: the whole up stack reads float32, and gate's blocks stay unfused
    assert "up_proj" not in runner.params["blocks"] and "gate_up_proj" not in runner.params["blocks"]
    assert {"gate_proj", "qkv_proj", "down_proj"} <= set(runner.params["blocks"])


def test_fused_stacks_are_their_parts_outputs_side_by_side():
    """`loader.fuse_block_stacks`: q/k/v and gate/up each as one stack whose output rows are the
    parts' in order (the kernel's outputs then are the parts' bits, split), only where every part
    has blocks of one kind; a group with a part missing or of another kind stays as it is."""
    rng = np.random.default_rng(11)
    stacks = {name: random_blocks(rng, (2, n, 64), "Q4_1") for name, n in
              (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("gate_proj", 96), ("o_proj", 64))}
    stacks["up_proj"] = random_blocks(rng, (2, 96, 64), "Q8_0")  # another kind than gate's
    fused = loader.fuse_block_stacks({name: BlockWeights(*map(_device, b)) for name, b in stacks.items()})
    assert sorted(fused) == ["gate_proj", "o_proj", "qkv_proj", "up_proj"]
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    whole = np.asarray(cpu_kernels.rows_matmul_blocks(x, fused["qkv_proj"], 1))
    parts = [np.asarray(cpu_kernels.rows_matmul_blocks(x, BlockWeights(*map(_device, stacks[n])), 1))
             for n in ("q_proj", "k_proj", "v_proj")]
    np.testing.assert_array_equal(whole, np.concatenate(parts, axis=-1))
    assert "gate_up_proj" not in loader.fuse_block_stacks({"gate_proj": fused["gate_proj"]})


def _device(array):
    return None if array is None else jnp.asarray(array)


def test_no_blocks_without_the_cpu_matmul_kernel(quantized):
    runner = TargetRunner(quantized, page_size=8, max_total_tokens=256, max_num_seqs=2, cpu_matmul=False)
    assert "blocks" not in runner.params
