"""Load a Hugging Face Llama / Qwen3 safetensors checkpoint into the params pytree.

params = {"embed": [V,H], "norm": [H], "lm_head": [V,H] (the embed array itself when tied),
          "layers": {name: [num_layers, ...]}}
Projection weights are stored transposed ([in, out]) so the model computes `x @ w`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jax_backend.blocks import BlockWeights, TiledQ4, load_blocks, tile_q4
from jax_backend.config import CheckpointError, TargetConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Per-layer tensors: our name -> (HF name suffix, transpose to [in, out]).
_LAYER_TENSORS = {
    "input_norm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "post_norm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}


def expected_shapes(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the model reads."""
    H, I, V, D = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * D, config.num_key_value_heads * D
    per_layer = {
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q_dim, H),
        "self_attn.k_proj.weight": (kv_dim, H),
        "self_attn.v_proj.weight": (kv_dim, H),
        "self_attn.o_proj.weight": (H, q_dim),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
    }
    if config.qk_norm:
        per_layer["self_attn.q_norm.weight"] = (D,)
        per_layer["self_attn.k_norm.weight"] = (D,)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(config.num_hidden_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    return shapes


def load_target(
    model_dir: str | os.PathLike,
    dtype: str = "float32",
    sharding: Callable[[str, int], jax.sharding.Sharding] | None = None,
    gguf_blocks: bool = False,
) -> tuple[TargetConfig, dict]:
    """Read config.json and the safetensors weights of `model_dir`; return (config, params).

    `gguf_blocks` (float32, one device): params["blocks"] also holds the projections and lm_head
    that the checkpoint keeps as GGUF blocks decoding to exactly the float32 weights loaded
    (`jax_backend.blocks`; {} where it has none): out-major stacks for the CPU matmul kernel.

    `sharding(params key, ndim)` -> Sharding places each array straight from the host onto its
    devices (tensor parallelism: each device receives only its shard; the whole
    array never lands on one device). None: the default device."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {model_dir}")
    config = TargetConfig.from_file(model_dir / "config.json")
    tensors = _TensorFiles(model_dir)
    shapes = expected_shapes(config)
    missing = [name for name in shapes if name not in tensors.names]
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise CheckpointError(f"{model_dir}: missing tensors: {shown}")

    target = _DTYPES[dtype]

    def put(name: str, array: np.ndarray) -> jax.Array:
        return jnp.asarray(array) if sharding is None else jax.device_put(array, sharding(name, array.ndim))

    def read(name: str, transpose: bool = False) -> np.ndarray:
        array = tensors.read(name)
        if tuple(array.shape) != shapes[name]:
            raise CheckpointError(
                f"{model_dir}: tensor {name!r} has shape {tuple(array.shape)}, "
                f"expected {shapes[name]} from config.json"
            )
        array = array.astype(target)
        return array.T if transpose else array

    layers, block_stacks = {}, {}
    with_blocks = gguf_blocks and sharding is None and target == jnp.float32
    for ours, (suffix, transpose) in _LAYER_TENSORS.items():
        if ours in ("q_norm", "k_norm") and not config.qk_norm:
            continue
        names = [f"model.layers.{i}.{suffix}" for i in range(config.num_hidden_layers)]
        raw = [read(name) for name in names]
        if with_blocks and transpose:
            found = load_blocks(model_dir, dict(zip(names, raw)))
            if len(found) == len(names):  # every layer's, or none: the kernel reads one stack
                block_stacks[ours] = _stack_blocks([found[name] for name in names])
        stacked = np.stack([w.T if transpose else w for w in raw])
        del raw
        layers[ours] = put(ours, stacked)
        del stacked
    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    head = read(head_name)
    embed = put("embed", head if config.tie_word_embeddings else read("model.embed_tokens.weight"))
    params = {
        "embed": embed,
        "layers": layers,
        "norm": put("norm", read("model.norm.weight")),
        "lm_head": embed if config.tie_word_embeddings else put("lm_head", head),
    }
    if with_blocks:
        found = load_blocks(model_dir, {head_name: head})
        if found:
            block_stacks["lm_head"] = BlockWeights(*(None if a is None else jnp.asarray(a) for a in found[head_name]))
        params["blocks"] = amx_tiled(fuse_block_stacks(block_stacks))
    return config, params


def amx_tiled(stacks: dict[str, BlockWeights]) -> dict:
    """Where this process runs Q4_1 products on AMX tiles (`cpu_kernels.amx_products`), its Q4_1
    stacks of N % 16 == 0 in their tile order (`blocks.TiledQ4`)."""
    from jax_backend import cpu_kernels

    if not cpu_kernels.amx_products():
        return stacks
    tiled = lambda b: TiledQ4(*(jnp.asarray(a) for a in tile_q4(b)))  # noqa: E731
    return {name: tiled(b) if b.offset is not None and b.codes.shape[-2] % 16 == 0 else b for name, b in stacks.items()}


def _stack_blocks(per_layer: list[BlockWeights]) -> BlockWeights:
    return BlockWeights(*(None if a[0] is None else jnp.asarray(np.stack(a)) for a in zip(*per_layer)))


# Block stacks read by one kernel call each (`model.project_parts`): their outputs side by side.
FUSED_BLOCKS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_block_stacks(stacks: dict[str, BlockWeights]) -> dict[str, BlockWeights]:
    """q/k/v and gate/up each as one stack of their output rows concatenated, where every part has
    blocks of one kind: one kernel call instead of three or two, each output the same sum (90 fewer
    calls a step: a batch-1 decode step 0.92-0.96x; docs/performance.md section 43). A part
    without blocks leaves its group as it is."""
    out = dict(stacks)
    for fused, parts in FUSED_BLOCKS.items():
        found = [stacks.get(part) for part in parts]
        if all(f is not None for f in found) and len({(f.codes.shape[-1], f.offset is None) for f in found}) == 1:
            out[fused] = BlockWeights(*(None if a[0] is None else jnp.concatenate(a, axis=-2) for a in zip(*found)))
            for part in parts:
                del out[part]
    return out


class _TensorFiles:
    """Name -> file lookup over model.safetensors or a sharded set with an index.json."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is malformed: {e!r}") from e
            files = {model_dir / f for f in set(weight_map.values())}
        elif single.is_file():
            files = {single}
        else:
            files = set(model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{model_dir}: no model.safetensors (or *.safetensors) weights")
        self.file_of: dict[str, Path] = {}
        for path in sorted(files):
            if not path.is_file():
                raise CheckpointError(f"{model_dir}: weight file listed in the index is missing: {path.name}")
            try:
                with safe_open(path, framework="numpy") as f:
                    for name in f.keys():
                        self.file_of[name] = path
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
        self.names = set(self.file_of)

    def read(self, name: str) -> np.ndarray:
        path = self.file_of[name]
        with safe_open(path, framework="numpy") as f:
            if f.get_slice(name).get_dtype() == "BF16":
                # numpy has no bfloat16: read the raw bytes and view them as ml_dtypes.bfloat16.
                return _read_raw_bf16(path, name)
            return f.get_tensor(name)


def _read_raw_bf16(path: Path, name: str) -> np.ndarray:
    """Read one BF16 tensor straight from the safetensors layout: u64 header length, JSON header
    {name: {dtype, shape, data_offsets}}, then the data block."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(header_len))[name]
        start, end = info["data_offsets"]
        f.seek(8 + header_len + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(info["shape"])

