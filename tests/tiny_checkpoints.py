"""Tiny random-weight target checkpoints in Hugging Face format, built with transformers.

Shared by every test that needs a target model: `make_tiny_target(path, arch, **overrides)` writes
config.json + model.safetensors under `path` and returns `path`. Weights are float32 and seeded,
so the same arguments always give the same checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

_DEFAULTS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    # Larger than HF's 0.02 so that tiny models have peaked (not near-uniform) next-token
    # distributions: greedy decoding is then robust to float noise.
    initializer_range=0.1,
)
_ARCH_DEFAULTS = {
    "qwen3": dict(tie_word_embeddings=False, rope_theta=1_000_000.0),
    # SmolLM2 style: tied embeddings.
    "llama": dict(tie_word_embeddings=True, rope_theta=100_000.0),
}


def make_tiny_target(
    path: str | os.PathLike,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    norm_noise: float = 0.2,
    max_shard_size: str | None = None,
    save_dtype: str = "float32",
    **overrides,
) -> str:
    """Build a random `Qwen3ForCausalLM` ("qwen3") or `LlamaForCausalLM` ("llama") and save it.

    `overrides` are config keys (e.g. `num_hidden_layers=2`, `tie_word_embeddings=True`,
    `rope_scaling={...}`). RMSNorm weights (including Qwen3's q_norm/k_norm) are set to
    `1 + norm_noise * N(0, 1)` instead of all-ones so that a norm applied in the wrong place is
    visible in logits. `max_shard_size` (e.g. "100KB") writes a sharded checkpoint with
    model.safetensors.index.json. `save_dtype="bfloat16"` stores the weights in bfloat16.
    Returns `str(path)`.
    """
    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"arch must be 'qwen3' or 'llama', got {arch!r}")
    kwargs = {**_DEFAULTS, **_ARCH_DEFAULTS[arch], **overrides}
    rope_theta = kwargs.pop("rope_theta")
    rope_scaling = kwargs.pop("rope_scaling", None)
    rope_parameters = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
    if "type" in rope_parameters:  # legacy key name
        rope_parameters["rope_type"] = rope_parameters.pop("type")
    config_cls, model_cls = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    config = config_cls(rope_parameters=rope_parameters, **kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                param.copy_(1.0 + norm_noise * noise)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model = model.to(getattr(torch, save_dtype))
    model.save_pretrained(path, **save_kwargs)
    return str(path)


def load_hf_model(path: str | os.PathLike) -> torch.nn.Module:
    """Load a checkpoint written by `make_tiny_target` back into transformers (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
