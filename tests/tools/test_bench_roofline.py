"""bench_target --roofline: the roofline arithmetic, and a smoke run on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest

from jax_backend import TargetConfig
from sgl_dflash.tools import bench_roofline
from sgl_dflash.tools.bench_target import SMOLLM2_135M
from tests.tiny_checkpoints import make_tiny_target


def test_roofline_of_the_smollm2_shape():
    config = TargetConfig.from_dict({**SMOLLM2_135M, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    machine = {"read_bandwidth_gbs": 20.0, "matmul_fp32_gflops": 170.0}
    weights = 538_000_000
    decode = bench_roofline.roofline(config, weights, batch=1, k=1, context=256, machine=machine)
    kv_token = 2 * 30 * 3 * 64 * 4  # 46 KB per token per sequence
    assert decode["bytes"] == weights + 257 * kv_token
    assert decode["bound"] == "memory"
    assert decode["roofline_ms"] == pytest.approx(decode["bytes"] / 20e9 * 1e3)
    # ~0.27 GFLOP per token (matmuls + lm_head), as REFERENCES.md says
    assert 0.25e9 < decode["flops"] < 0.3e9
    big = bench_roofline.roofline(config, weights, batch=32, k=1, context=256, machine=machine)
    assert big["bound"] == "compute" and big["roofline_ms"] == pytest.approx(big["flops"] / 170e9 * 1e3)
    assert bench_roofline.aux_layers(30) == (1, 10, 18, 27)


def test_roofline_run_writes_json_and_png(tmp_path):
    model = make_tiny_target(tmp_path / "model", "llama", num_hidden_layers=2)
    result = bench_roofline.run(model, None, context=40, repeats=1, hf_max_batch=4, out_dir=tmp_path,
                                cases=[(1, 1), (2, 4)])
    assert (tmp_path / "roofline.png").stat().st_size > 0
    saved = json.loads((tmp_path / "roofline.json").read_text())
    assert saved["backend"] == result["backend"] == "cpu"
    assert [(r["batch"], r["k"]) for r in saved["rows"]] == [(1, 1), (2, 4)]
    for row in saved["rows"]:
        assert row["ours_ms"] > 0 and row["dense_jax_ms"] > 0 and row["xla_dots_ms"] > 0 and row["roofline_ms"] > 0
        assert row["ours_over_roofline"] == pytest.approx(row["ours_ms"] / row["roofline_ms"])
        assert row["ours_xla_attention_ms"] > 0  # a CPU run times ours without the CPU kernels too
        assert row["ours_xla_matmul_ms"] > 0 and row["kernel_dots_ms"] > 0
    assert saved["runner"]["cpu_attention"] is True and saved["runner"]["cpu_matmul"] is True
    bench_roofline.print_table(result)


def test_the_dots_only_step_keeps_every_matmul(tmp_path):
    """`dots_step` is a floor for the step's matmuls only if XLA drops none of them: its compiled
    FLOPs cover every projection and the lm_head at M rows (the roofline's matmul FLOPs)."""
    import jax
    import jax.numpy as jnp

    from jax_backend import TargetRunner

    model = make_tiny_target(tmp_path / "model", "llama", num_hidden_layers=2)
    runner = TargetRunner(model, max_total_tokens=256, max_num_seqs=2, max_model_len=64)
    dots = bench_roofline.DotsOnly(runner, vocab_major=True)
    rows, c = 4, runner.config
    h = jnp.ones((rows, c.hidden_size), jnp.float32)
    compiled = jax.jit(lambda p, h: bench_roofline.dots_step(p, c, h, True)).lower(dots.params, h).compile()
    flops = compiled.cost_analysis()["flops"]
    no_attention = bench_roofline.roofline(c, 0, batch=rows, k=1, context=0,
                                           machine={"read_bandwidth_gbs": 1.0, "matmul_fp32_gflops": 1.0})["flops"]
    no_attention -= 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * rows  # the roofline's K=1 scores
    assert no_attention <= flops <= 1.2 * no_attention
    dots.run(rows)


def test_a_step_that_reads_gguf_blocks_is_measured_against_their_bytes(tmp_path):
    import jax

    from jax_backend import TargetRunner
    from jax_backend.model import BLOCKS_MAX_ROWS
    from tests.jax_backend.test_gguf_blocks import quantize_checkpoint

    model = make_tiny_target(tmp_path / "model", "llama", num_hidden_layers=2)
    quantize_checkpoint(model)
    runner = TargetRunner(model, max_total_tokens=256, max_num_seqs=2, greedy_head=False)
    full = bench_roofline.target_bytes(runner)
    float32 = TargetRunner(model, max_total_tokens=256, max_num_seqs=2, gguf_blocks=False, greedy_head=False)
    assert full == bench_roofline.target_bytes(float32) == bench_roofline.weight_bytes_read(float32, 1)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    blocks = nbytes(runner.params["blocks"])
    few = bench_roofline.weight_bytes_read(runner, BLOCKS_MAX_ROWS)
    assert few < full / 3 and few > blocks  # the norms stay float32
    assert bench_roofline.weight_bytes_read(runner, BLOCKS_MAX_ROWS + 1) == full
    # The greedy head's steps read its int8 tiles in place of the head's blocks (or float32 head past
    # the blocks' rows); its copy is not part of the float32 weights.
    headed = TargetRunner(model, max_total_tokens=256, max_num_seqs=2, greedy_head=True)
    head, head_blocks = nbytes(headed.params["greedy_head"]), nbytes(headed.params["blocks"]["lm_head"])
    assert bench_roofline.target_bytes(headed) == full
    assert bench_roofline.weight_bytes_read(headed, 16) == bench_roofline.weight_bytes_read(runner, 16) - head_blocks + head
    assert bench_roofline.weight_bytes_read(headed, 1) == bench_roofline.weight_bytes_read(runner, 1) - head_blocks + head
    assert bench_roofline.weight_bytes_read(headed, 65) == full
