"""DFlash drafter training: the pieces that define what is learned (see trainer.py for the loop).

Recipe (DFlash paper arXiv 2602.06036, SpecForge):
- the target is frozen (its embedding and lm_head too); the drafter's layers, `fc` and norms train;
- anchors: positions `i` of the response whose next token is supervised;
- block input `[x_anchor, MASK x (B-1)]` at positions `anchor .. anchor+B-1`;
- attention: block b sees context features at positions STRICTLY before anchor_b (exactly what it
  will see at inference: features of committed tokens only; the anchor token is the bonus token
  whose features do not exist yet) plus its own block, bidirectionally;
- loss: sum_k w_k CE(lm_head(h_k), x_{anchor+k}) / sum_k w_k, k = 1..B-1, w_k = exp(-(k-1)/gamma);
- AdamW lr 6e-4, cosine schedule with 4% warmup, gradient clipping at 1.0.

Context features are the target's layer OUTPUTS `hidden_states[l + 1]` for l in target_layer_ids.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import save_file

_GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


class TrainingDataError(ValueError):
    """Training inputs are unusable (empty, too short, mismatched shapes); the message says which."""


# ----------------------------------------------------------------------------------------------
# Drafter construction
# ----------------------------------------------------------------------------------------------


def loss_gamma(block_size: int) -> float:
    """Decay of the per-position loss weights: the paper's values, interpolated elsewhere."""
    if block_size in _GAMMA_BY_BLOCK_SIZE:
        return _GAMMA_BY_BLOCK_SIZE[block_size]
    return max(1.0, 4.0 + 3.0 * (block_size - 8) / 8)


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block offsets k = 1..B-1 (offset 0 is the given anchor token)."""
    gamma = loss_gamma(block_size) if gamma is None else gamma
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def build_draft_config(
    target_config: dict,
    *,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
    dflash2: dict | None = None,
) -> dict:
    """A z-lab DFlash config.json dict for a drafter of `target_config` (an HF config dict).

    The drafter shares the target's hidden size (it uses the target's embedding and lm_head) and
    attention geometry. `mask_token_id` defaults to the last vocabulary id. `dflash2` (the keys
    conv_kernel_size, conv_group_size, selector_rank, selector_top_k) makes it a DFlash 2 drafter.
    """
    num_target_layers = int(target_config["num_hidden_layers"])
    hidden = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    if target_layer_ids is None:
        from torchax_proposer import default_target_layer_ids

        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise TrainingDataError(f"target_layer_ids {bad} outside [0, {num_target_layers})")
    vocab_size = int(target_config["vocab_size"])
    if mask_token_id is None:
        mask_token_id = vocab_size - 1
    if not 0 <= mask_token_id < vocab_size:
        raise TrainingDataError(f"mask_token_id {mask_token_id} outside the vocabulary [0, {vocab_size})")
    rope_theta = target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0
    )
    config = {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": int(intermediate_size or target_config["intermediate_size"]),
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_config.get("num_key_value_heads", heads)),
        "head_dim": int(target_config.get("head_dim") or hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 8192)),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "num_target_layers": num_target_layers,
        "block_size": int(block_size),
        "dflash_config": {
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": target_layer_ids,
            "block_size": int(block_size),
        },
        "torch_dtype": "float32",
    }
    if dflash2:
        config["dflash_config"].update({k: int(v) for k, v in dflash2.items()})
        from torchax_proposer import DFlashConfig, DraftCheckpointError

        try:  # the drafter's own validation (group size dividing hidden, K <= vocab, ...)
            DFlashConfig.from_dict(config)
        except DraftCheckpointError as err:
            raise TrainingDataError(str(err)) from err
    return config


def new_draft_model(config: dict, *, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised drafter (z-lab parameter names; DFlash 1 or 2 as `config` says) in
    float32. Linear weights ~ N(0, 0.02) like transformers' Qwen3 init; norms start at one; DFlash
    2's convolutions start as the identity and its selector as a no-op (their own init)."""
    from torchax_proposer import DFlashConfig
    from torchax_proposer.dflash2 import GroupedDynamicCausalConv, build_draft_model

    torch.manual_seed(seed)
    model = build_draft_model(DFlashConfig.from_dict(config)).to(torch.float32)
    conv_linears = {id(m.kernel_projection) for m in model.modules() if isinstance(m, GroupedDynamicCausalConv)}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and id(module) not in conv_linears:
                module.weight.normal_(0.0, 0.02)
                if module.bias is not None:
                    module.bias.zero_()
    return model


# ----------------------------------------------------------------------------------------------
# The block attention mask
# ----------------------------------------------------------------------------------------------


def block_attention_mask(seq_len: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean mask `[batch, 1, nb*B, seq_len + nb*B]` (True = may attend).

    Keys are `[context features (seq_len) | all blocks (nb*B)]`. Query rows of block b see context
    positions `< anchors[:, b]` and the B rows of block b. `anchors`: int64 `[batch, nb]`; padded
    anchor slots are fine (their rows are ignored by the loss).
    """
    batch, num_blocks = anchors.shape
    q_block = torch.arange(num_blocks * block_size, device=anchors.device) // block_size  # [Q]
    row_anchor = anchors[:, q_block]  # [batch, Q]
    ctx_visible = torch.arange(seq_len, device=anchors.device)[None, None, :] < row_anchor[:, :, None]
    same_block = q_block[:, None] == q_block[None, :]
    block_visible = same_block[None].expand(batch, -1, -1)
    return torch.cat([ctx_visible, block_visible], dim=-1)[:, None]


# ----------------------------------------------------------------------------------------------
# Optimisation
# ----------------------------------------------------------------------------------------------


def lr_at(step: int, total_steps: int, lr: float, warmup_frac: float = 0.04) -> float:
    """Linear warmup over `warmup_frac` of the steps, then cosine decay to zero."""
    warmup = max(1, int(round(warmup_frac * total_steps)))
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                             betas=(0.9, 0.95), weight_decay=weight_decay)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
                   lr: float, clip: float = 1.0) -> float:
    """Backward, clip the global grad norm to `clip`, step at learning rate `lr`; returns the norm."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return float(norm)


# ----------------------------------------------------------------------------------------------
# Checkpoint output (z-lab format)
# ----------------------------------------------------------------------------------------------


def save_draft_checkpoint(model: torch.nn.Module, config: dict, out_dir: str | os.PathLike, *,
                          dtype: torch.dtype = torch.float32, extra: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (no `model.` prefix, no embedding/lm_head)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in model.state_dict().items()}
    config = dict(config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["dtype"] = config["torch_dtype"]
    if extra:
        config.update(extra)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


# ----------------------------------------------------------------------------------------------
# The frozen target
# ----------------------------------------------------------------------------------------------


def load_frozen_target(target_dir: str | os.PathLike) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def target_embed_and_head(target: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings()
    return embed, (head.weight.detach() if head is not None else embed)


def init_from_target_layers(model: torch.nn.Module, target_dir: str | os.PathLike,
                            layer_ids: Sequence[int]) -> None:
    """Warm start for tiny data budgets: drafter layer i <- target layer n-L+i (same shapes: the
    drafter mirrors the target's geometry), `fc` reads the deepest captured layer, and
    `hidden_norm` takes the first copied layer's input norm, so context K/V start out as that
    target layer would compute them. q_norm/k_norm (absent in Llama) start at one."""
    from safetensors import safe_open

    config = json.loads((Path(target_dir) / "config.json").read_text())
    n, num = config["num_hidden_layers"], len(model.layers)
    index = Path(target_dir) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors = {}
    for name in files:
        with safe_open(str(Path(target_dir) / name), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.")})
    hidden = config["hidden_size"]
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            src = f"model.layers.{n - num + i}."
            for name, param in layer.named_parameters():
                if src + name in tensors:
                    param.copy_(tensors[src + name].to(param.dtype))
        deepest = int(np.argmax(layer_ids))
        model.fc.weight.zero_()
        model.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden)
        model.hidden_norm.weight.copy_(tensors[f"model.layers.{n - num}.input_layernorm.weight"])
