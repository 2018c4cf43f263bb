"""Writes tiny random DFlash drafter checkpoints in z-lab's format, for tests.

The tensor names and shapes are spelled out here from z-lab's format (not taken from our module),
so loading them checks our naming independently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

DFLASH_KEYS = ("mask_token_id", "target_layer_ids", "block_size")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# A small DFlash 2 setting for tests: 2-tap convolutions over groups of 16 channels, rank-8
# codebooks, 4 candidates per position.
DFLASH2_TINY = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)


def _target_dict(target_dir_or_config: Any) -> dict[str, Any]:
    if isinstance(target_dir_or_config, (str, Path)):
        return json.loads((Path(target_dir_or_config) / "config.json").read_text())
    if isinstance(target_dir_or_config, dict):
        return dict(target_dir_or_config)
    return target_dir_or_config.to_dict()  # a transformers config object


def _rope_theta(target: dict[str, Any]) -> float:
    rope = target.get("rope_parameters") or {}
    return float(rope.get("rope_theta", target.get("rope_theta", 10000.0)))


def make_tiny_draft(
    path: str | Path,
    target_dir_or_config: Any,
    *,
    num_layers: int = 1,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    dflash2: dict[str, int] | None = None,
    **overrides: Any,
) -> Path:
    """Writes config.json + model.safetensors of a random drafter that fits the given target.

    `dflash2`: the DFlash 2 keys (e.g. `DFLASH2_TINY`) make it a `DFlash2DraftModel` checkpoint in
    z-lab's format: those keys in `dflash_config`, convolution tensors in every layer and the
    selector's tensors, its two codebooks stored without a `.weight` suffix.

    `target_dir_or_config`: a target checkpoint directory, its config dict, or a transformers config.
    `target_layer_ids=None` leaves them out of the config (z-lab's default rule then applies).
    `overrides`: config keys; `mask_token_id` goes to `dflash_config`, others to the top level;
    a value of None removes the key.
    """
    target = _target_dict(target_dir_or_config)
    hidden = target["hidden_size"]
    heads = target["num_attention_heads"]
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads") or heads,
        "head_dim": target.get("head_dim") or hidden // heads,
        "intermediate_size": target["intermediate_size"],
        "vocab_size": target["vocab_size"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_theta": _rope_theta(target),
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "num_target_layers": target["num_hidden_layers"],
        "tie_word_embeddings": False,
        "dtype": "float32",
        "dflash_config": {"mask_token_id": target["vocab_size"] - 1, "block_size": block_size},
    }
    if target_layer_ids is not None:
        config["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    if dflash2 is not None:
        config["architectures"] = ["DFlash2DraftModel"]
        config["dflash_config"].update(dflash2)
    for key, value in overrides.items():
        where = config["dflash_config"] if key in DFLASH_KEYS + DFLASH2_KEYS else config
        if value is None:
            where.pop(key, None)
        else:
            where[key] = value

    # Without explicit ids, z-lab's default rule picks one target layer per draft layer.
    num_ids = len(config["dflash_config"].get("target_layer_ids", [None] * num_layers))
    head_dim, kv_heads = config["head_dim"], config["num_key_value_heads"]
    q_heads, inter = config["num_attention_heads"], config["intermediate_size"]
    shapes = {"fc.weight": (hidden, num_ids * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
        if config.get("attention_bias"):
            for name, size in (("q", q_heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim), ("o", hidden)):
                shapes[p + f"self_attn.{name}_proj.bias"] = (size,)

    if dflash2 is not None:
        taps, rank = dflash2["conv_kernel_size"], dflash2["selector_rank"]
        groups = hidden // dflash2["conv_group_size"]
        for i in range(num_layers):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, hidden)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * groups, hidden)
        shapes["candidate_selector.hidden_projection.weight"] = (rank, hidden)
        shapes["candidate_selector.predecessor_codebook"] = (config["vocab_size"], rank)
        shapes["candidate_selector.successor_codebook"] = (config["vocab_size"], rank)

    # Scaled so activations stay O(1) through the layers: drafts then depend on the inputs and
    # differ from token to token, which is what the exactness tests need.
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("base_kernel"):
            # Around the identity (tap 0 = 1), with a clearly non-zero second tap.
            tensors[name] = 0.5 * torch.randn(shape, generator=gen)
            tensors[name][:, 0] += 1.0
        elif name.endswith("_codebook"):
            # Transition scores of the order of the gaps between top logits, so that the
            # selector's path often differs from the per-position argmax.
            tensors[name] = torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            tensors[name] = 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def context_features(target: torch.nn.Module, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """DFlash context features of every position of input_ids [1, T] under a transformers target:
    cat of the OUTPUTS of the given target layers (hidden_states[l + 1]) -> [T, len(ids) * H]."""
    with torch.no_grad():
        hidden_states = target(input_ids, output_hidden_states=True).hidden_states
    return torch.cat([hidden_states[layer + 1][0] for layer in layer_ids], dim=-1)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """Tiny torch ops on a shared 2-core machine: a second intra-op thread only adds contention
    (measured: a 30x64 linear took ~14 ms with 2 threads under load, ~0.08 ms with 1).
    Import this fixture into a test module to apply it there; restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
