"""Loads a z-lab DFlash drafter checkpoint (config.json + *.safetensors) and checks it fits the target.

Both architectures: `DFlashDraftModel` and `DFlash2DraftModel` (whose tensor names, codebooks
included, are exactly our module's parameter names: no key mapping needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import DFlashConfig, DraftCheckpointError
from .dflash2 import build_draft_model
from .model import DFlashDraftModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def read_draft_config(draft_dir: str | Path, target_config: dict[str, Any]) -> DFlashConfig:
    """Parses `<draft_dir>/config.json` and checks it against the target.

    `target_config`: {"hidden_size", "vocab_size", "num_hidden_layers"} of the target model.
    """
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if key not in target_config:
            raise ValueError(f"target_config is missing {key!r}")
    target_layers = int(target_config["num_hidden_layers"])
    config = DFlashConfig.from_pretrained(draft_dir, num_target_layers=target_layers)

    # Embedding and lm_head are the target's, so the drafter must live in the target's spaces.
    if config.hidden_size != target_config["hidden_size"]:
        raise DraftCheckpointError(
            f"drafter hidden_size={config.hidden_size} != target hidden_size={target_config['hidden_size']} "
            "(the drafter uses the target's embedding and lm_head)"
        )
    if config.vocab_size != target_config["vocab_size"]:
        raise DraftCheckpointError(
            f"drafter vocab_size={config.vocab_size} != target vocab_size={target_config['vocab_size']}"
        )
    if not 0 <= config.mask_token_id < target_config["vocab_size"]:
        raise DraftCheckpointError(
            f"drafter mask_token_id={config.mask_token_id} is outside the target vocabulary "
            f"[0, {target_config['vocab_size']})"
        )
    if config.num_target_layers is not None and config.num_target_layers != target_layers:
        raise DraftCheckpointError(
            f"drafter num_target_layers={config.num_target_layers} != target num_hidden_layers={target_layers}"
        )
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < target_layers]
    if bad_ids:
        raise DraftCheckpointError(
            f"drafter target_layer_ids {list(config.target_layer_ids)} has {bad_ids} out of range of the "
            f"target's {target_layers} layers"
        )
    return config


def load_draft_model(
    draft_dir: str | Path, target_config: dict[str, Any], dtype: str | torch.dtype = "float32"
) -> DFlashDraftModel:
    """Builds the drafter (a `DFlash2DraftModel` for DFlash 2 checkpoints) from a z-lab checkpoint
    directory; raises `DraftCheckpointError` when the checkpoint is incomplete, malformed or does
    not fit the target."""
    dtype = torch_dtype(dtype)
    config = read_draft_config(draft_dir, target_config)
    tensors = _read_tensors(Path(draft_dir))

    with torch.device("meta"):
        model = build_draft_model(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise DraftCheckpointError(f"drafter checkpoint {draft_dir} is missing tensors: {missing}")
    if unexpected:
        raise DraftCheckpointError(f"drafter checkpoint {draft_dir} has unexpected tensors: {unexpected}")
    wrong = [
        f"{name}: {tuple(tensors[name].shape)} (expected {shape})"
        for name, shape in expected.items()
        if tuple(tensors[name].shape) != shape
    ]
    if wrong:
        raise DraftCheckpointError(f"drafter checkpoint {draft_dir} has tensors of the wrong shape: {wrong}")
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise DraftCheckpointError(f"drafter tensor {name} has non-float dtype {tensor.dtype}")

    model.load_state_dict({name: t.to(dtype) for name, t in tensors.items()}, strict=True, assign=True)
    model.reset_rope()
    return model.eval().requires_grad_(False)


def _read_tensors(draft_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise DraftCheckpointError(f"no *.safetensors file in drafter directory {draft_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            part = load_file(file)
        except (SafetensorError, OSError) as err:
            raise DraftCheckpointError(f"cannot read {file}: {err}") from err
        duplicated = sorted(set(part) & set(tensors))
        if duplicated:
            raise DraftCheckpointError(f"tensors {duplicated} appear in more than one file of {draft_dir}")
        tensors.update(part)
    return tensors
