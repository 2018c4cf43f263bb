"""Narrow draft steps (`jax_drafter.draft_weights`) served with the CPU matmul kernel: a bfloat16
drafter checkpoint's nn.Linear weights kept bfloat16 (`jax_drafter.bfloat16_linear_weights`), the
head as the target's GGUF blocks; the kernel reads them as such, computing with their exact
float32 values: the same drafts and logits, bit for bit, as reading them in float32, and the
eager torch drafter's within float32 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jax_backend import cpu_kernels, greedy_head
from jax_backend.blocks import BlockWeights, dequantize
from tests.jax_backend.test_gguf_blocks import random_blocks
from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft, single_torch_thread  # noqa: F401
from torchax_proposer import DFlashProposer, load_draft_model
from torchax_proposer.torch_drafter import TorchDrafter

TARGET = dict(hidden_size=64, vocab_size=256, num_hidden_layers=4)


@pytest.fixture(scope="module")
def bf16_draft(tmp_path_factory):
    """A tiny drafter whose weights are all bfloat16 numbers (stored as float32, like a bf16
    checkpoint loaded in float32)."""
    target_dir = make_tiny_target(tmp_path_factory.mktemp("target"), "qwen3", num_hidden_layers=4)
    draft_dir = make_tiny_draft(tmp_path_factory.mktemp("draft"), target_dir, num_layers=2, block_size=8,
                                target_layer_ids=[1, 2])
    path = draft_dir / "model.safetensors"
    tensors = {name: np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32)) for name, w in load_file(path).items()}
    save_file(tensors, str(path))
    return draft_dir


def test_a_bfloat16_drafter_drafts_the_same_bits_from_half_the_bytes(bf16_draft):
    assert cpu_kernels.available()
    rng = np.random.default_rng(0)
    embed, lm_head = (0.1 * rng.standard_normal((2, 256, 64))).astype(np.float32)
    seen = {"bf16": [], "f32": []}

    def reading(kind):
        def kernel(x, w):
            seen[kind].append(w.dtype)
            return cpu_kernels.rows_matmul(x, w if kind == "bf16" else w.astype(jnp.float32))
        return kernel

    make = lambda kind: DFlashProposer(bf16_draft, target_embed=embed, target_lm_head=lm_head,  # noqa: E731
                                       target_config=TARGET, max_num_seqs=4, max_context_len=128,
                                       few_row_matmul=reading(kind))
    proposers = {kind: make(kind) for kind in seen}
    narrow = [name for name, w in proposers["bf16"].narrow_params.items() if w.dtype == jnp.bfloat16]
    # fc, every layer's context k/v stack, and per layer the q/k/v stack, o, the gate/up stack and down
    assert "fc.weight" in narrow and "layers.1.mlp.down_proj.weight" in narrow and len(narrow) == 2 + 2 * 4
    assert all(w.dtype == jnp.float32 for name, w in proposers["bf16"].narrow_params.items() if "norm" in name)
    assert all(w.dtype == jnp.float32 for w in proposers["bf16"].params.values())  # wide steps, ingest
    without_kernel = DFlashProposer(bf16_draft, target_embed=embed, target_lm_head=lm_head, target_config=TARGET,
                                    max_num_seqs=2, max_context_len=128)
    assert without_kernel.narrow_params is without_kernel.params  # XLA's dots: float32 as loaded
    eager = TorchDrafter(load_draft_model(bf16_draft, TARGET), torch.from_numpy(embed), torch.from_numpy(lm_head))
    prompt = rng.standard_normal((20, 128)).astype(np.float32)
    for p in proposers.values():
        p.add(0, jax.device_put(prompt))
    eager.add(0, torch.from_numpy(prompt))
    for step in range(3):
        bonus = rng.integers(0, 256, 1)
        out = {kind: p.propose([0], bonus, return_logits=True) for kind, p in proposers.items()}
        np.testing.assert_array_equal(out["bf16"][0], out["f32"][0])
        np.testing.assert_array_equal(out["bf16"][1], out["f32"][1])
        eager_tokens, eager_logits = eager.propose([0], bonus.tolist(), return_logits=True)
        np.testing.assert_allclose(out["bf16"][1], eager_logits.numpy(), atol=1e-5, rtol=0)
        accepted = rng.integers(0, 8, 1)
        new = rng.standard_normal((int(accepted[0]) + 1, 128)).astype(np.float32)
        for p in proposers.values():
            p.commit([0], accepted, [jax.device_put(new)])
        eager.commit([0], accepted.tolist(), [torch.from_numpy(new)])
    assert jnp.bfloat16 in seen["bf16"]  # one sequence, 8 rows: the kernel was handed the bfloat16 weights

    # Four sequences x 8 rows: past NARROW_ROWS the float32 weights (the same drafts again).
    for seq in (1, 2, 3):
        for p in proposers.values():
            p.add(seq, jax.device_put(prompt[: 5 + seq]))
    seen["bf16"].clear()
    bonus = rng.integers(0, 256, 4)
    wide = {kind: p.propose([0, 1, 2, 3], bonus, return_logits=True) for kind, p in proposers.items()}
    np.testing.assert_array_equal(wide["bf16"][0], wide["f32"][0])
    np.testing.assert_array_equal(wide["bf16"][1], wide["f32"][1])
    assert seen["bf16"] and jnp.bfloat16 not in seen["bf16"]


@pytest.mark.parametrize("token_map", [None, list(range(0, 256, 2))])
def test_the_targets_gguf_head_gives_the_same_drafts(bf16_draft, token_map):
    """`kernel_lm_head`: the target's lm_head as the kernel reads it (its GGUF blocks, here Q8_0
    decoding to the float32 lm_head): narrow draft steps read it, wide ones the float32 head; the
    drafts and logits are the float32 head's, bit for bit, with and without a token map."""
    assert cpu_kernels.available()
    rng = np.random.default_rng(1)
    head_blocks = random_blocks(rng, (256, 64), "Q8_0")
    lm_head = dequantize(head_blocks)
    embed = (0.1 * rng.standard_normal((256, 64))).astype(np.float32)
    heads = []

    def kernel(x, w):
        heads.append(type(w).__name__)
        return cpu_kernels.rows_matmul(x, w)

    make = lambda blocks: DFlashProposer(bf16_draft, target_embed=embed, target_lm_head=lm_head,  # noqa: E731
                                         target_config=TARGET, max_num_seqs=4, max_context_len=128,
                                         token_map=token_map, few_row_matmul=kernel, kernel_lm_head=blocks)
    proposers = {"blocks": make(head_blocks), "float32": make(None)}
    assert isinstance(proposers["blocks"].narrow_head, BlockWeights)
    assert proposers["float32"].narrow_head is proposers["float32"].lm_head
    prompt = rng.standard_normal((30, 128)).astype(np.float32)
    for seq in range(4):
        for p in proposers.values():
            p.add(seq, jax.device_put(prompt[: 10 + seq]))
    for seqs, kernel_head in (([0], True), ([0, 1, 2, 3], False)):  # 7 head rows, then 28 (past NARROW_ROWS)
        heads.clear()
        bonus = rng.integers(0, 256, len(seqs))
        out = {name: p.propose(seqs, bonus, return_logits=True) for name, p in proposers.items()}
        np.testing.assert_array_equal(out["blocks"][0], out["float32"][0])
        np.testing.assert_array_equal(out["blocks"][1], out["float32"][1])
        assert ("BlockWeights" in heads) == kernel_head


@pytest.mark.parametrize("token_map", [None, list(range(0, 256, 2))])
def test_the_greedy_head_gives_the_same_greedy_drafts(bf16_draft, token_map):
    """`greedy_head`: a propose that reads no logits takes its drafts from the target's greedy head
    kernel (`jax_backend.greedy_head.for_drafter`, over the token map's rows where there is one): the
    same drafts as the logits' argmax over several steps, at 7 and 28 head rows; logits and
    confidence keep the logits path; arrays of other rows than the drafter's head are an error."""
    assert cpu_kernels.available()
    rng = np.random.default_rng(2)
    head_blocks = random_blocks(rng, (256, 64), "Q8_0")
    lm_head = dequantize(head_blocks)
    embed = (0.1 * rng.standard_normal((256, 64))).astype(np.float32)
    calls = []

    def greedy(x, arrays):
        calls.append(x.shape[0])
        return greedy_head.drafter_tokens(x, arrays)

    params = {"lm_head": jnp.asarray(lm_head), "greedy_head": greedy_head.pack(jnp.asarray(lm_head))}
    _, arrays = greedy_head.for_drafter(params, token_map)
    assert arrays[0].shape == (256 if token_map is None else 128, 64)
    make = lambda g: DFlashProposer(  # noqa: E731
        bf16_draft, target_embed=embed, target_lm_head=lm_head, target_config=TARGET, max_num_seqs=4,
        max_context_len=128, token_map=token_map, few_row_matmul=cpu_kernels.rows_matmul, kernel_lm_head=head_blocks,
        greedy_head=g)
    proposers = {"greedy": make((greedy, arrays)), "logits": make(None)}
    if token_map is not None:
        with pytest.raises(ValueError, match="greedy_head's arrays must hold the drafter's lm_head rows"):
            make((greedy, greedy_head.for_drafter(params)[1]))
    prompt = rng.standard_normal((30, 128)).astype(np.float32)
    for seq in range(4):
        for p in proposers.values():
            p.add(seq, jax.device_put(prompt[: 10 + seq]))
    for seqs in ([0], [0, 1, 2, 3], [2]):
        for step in range(2):
            bonus = rng.integers(0, 256, len(seqs))
            out = {name: p.propose(seqs, bonus) for name, p in proposers.items()}
            np.testing.assert_array_equal(out["greedy"], out["logits"], err_msg=f"{seqs} {step}")
            if token_map is not None:
                assert np.isin(out["greedy"], token_map).all()
            accepted = rng.integers(0, 8, len(seqs))
            rows = [jax.device_put(rng.standard_normal((int(a) + 1, 128)).astype(np.float32)) for a in accepted]
            for p in proposers.values():
                p.commit(seqs, accepted, rows)
    assert sorted(set(calls)) == [7, 28]  # traced once per head shape
    calls.clear()
    bonus = rng.integers(0, 256, 1)
    tokens, confidence = proposers["greedy"].propose([0], bonus, return_confidence=True)
    assert not calls and confidence.shape == (1, 7)


@pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.amx_products()),
                    reason="this CPU (or build) has no AMX tiles: bf16 weights stay as they are")
def test_bf16_weights_in_tile_order_draft_as_float32_does_at_every_row_count(bf16_draft):
    """`narrow_layout=cpu_kernels.bf16_tile_order` with `rows_matmul(bf16_tiled=True)` (the DFLASH
    worker's setting on AMX hosts): the bfloat16 weights, in tile order, serve every kernel step up to
    FEW_ROWS rows (8 and 32 here), with the float32 drafter's drafts and its logits within float32
    accumulation's rounding."""
    import functools

    rng = np.random.default_rng(2)
    embed, lm_head = (0.1 * rng.standard_normal((2, 256, 64))).astype(np.float32)
    seen = []

    def tiled(x, w):
        seen.append(w.dtype)
        return cpu_kernels.rows_matmul(x, w, bf16_tiled=True)

    make = lambda **kw: DFlashProposer(bf16_draft, target_embed=embed, target_lm_head=lm_head,  # noqa: E731
                                       target_config=TARGET, max_num_seqs=4, max_context_len=128, **kw)
    tiles = make(few_row_matmul=tiled, narrow_layout=cpu_kernels.bf16_tile_order)
    f32 = make(few_row_matmul=lambda x, w: cpu_kernels.rows_matmul(x, w.astype(jnp.float32)))
    assert tiles.narrow_rows == 64 and f32.narrow_rows == 16
    w = tiles.narrow_params["layers.0.mlp.gate_up_stack"]
    assert w.dtype == jnp.bfloat16 and not jnp.array_equal(w, tiles.params["layers.0.mlp.gate_up_stack"].astype(jnp.bfloat16))
    prompt = rng.standard_normal((20, 128)).astype(np.float32)
    for seq in range(4):
        for p in (tiles, f32):
            p.add(seq, jax.device_put(prompt[: 8 + seq]))
    for seqs in ([0], [0, 1, 2, 3]):  # 8 rows, then 32 (past NARROW_ROWS: tiles still)
        seen.clear()
        bonus = rng.integers(0, 256, len(seqs))
        (t_tokens, t_logits), (f_tokens, f_logits) = (p.propose(seqs, bonus, return_logits=True) for p in (tiles, f32))
        np.testing.assert_array_equal(t_tokens, f_tokens)
        np.testing.assert_allclose(t_logits, f_logits, atol=1e-5, rtol=0)
        assert jnp.bfloat16 in seen
