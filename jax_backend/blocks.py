"""Projection weights kept as the checkpoint's GGUF quantization blocks, for the CPU matmul kernel.

A GGUF checkpoint stores SmolLM2's projections as Q4_1 (32 weights in 20 bytes) and its embedding
as Q8_0 (32 in 34); transformers dequantizes them to float32, which is what the target computes
with. Those float32 values are exact functions of the blocks (q * scale is exact in float32, so
q * scale + offset is one rounding), so `cpu_kernels.rows_matmul_blocks` can decode a tile's rows
in cache and compute the same products, bit for bit, while a decode step reads ~5.6x fewer bytes
of weights. `sgl_dflash.model_import` writes the blocks beside the float32 weights
(`BLOCKS_FILE`); `load_blocks` reads them back and keeps only those that decode to exactly the
float32 tensor the model loaded, so a stale or foreign file can never change a result.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

BLOCKS_FILE = "gguf_blocks.safetensors"
BLOCK = 32  # weights per block, along the input dimension
KINDS = ("Q4_1", "Q8_0")


class BlockWeights(NamedTuple):
    """Out-major weights [.., N, K] as blocks of 32 along K (a pytree of arrays).
    Q4_1: codes [.., N, K/2] uint8, byte j of a block holding q_j (low nibble) and q_{j+16}
    (high), w = q * scale + offset. Q8_0: codes [.., N, K] uint8 holding int8 q, w = q * scale,
    offset None. scale and offset: float32 [.., N, K/32]."""

    codes: object
    scale: object
    offset: object = None


class TiledQ4(NamedTuple):
    """Q4_1 `BlockWeights` [.., N, K] (N % 16 == 0) in the AMX products' tile order (`tile_q4`; only
    `cpu_kernels.rows_matmul_blocks` on AMX reads it): per 16 outputs and block b, 256 bytes of 16
    pair-rows i x 16 outputs n, byte = q[n, 32b + 2i] | q[n, 32b + 2i + 1] << 4; scale and offset
    per 16 outputs and block as 16 floats. The same shapes and bytes as the blocks, reordered."""

    codes: object
    scale: object
    offset: object


def tile_q4(blocks: BlockWeights) -> TiledQ4:
    """`TiledQ4` of Q4_1 blocks whose N is a multiple of 16."""
    codes, scale, offset = (np.asarray(a) for a in blocks)
    *lead, n, half = codes.shape
    g, nb = n // 16, half // 16
    c = codes.reshape(*lead, n, nb, 16)
    q = np.concatenate([c & 15, c >> 4], axis=-1).reshape(*lead, g, 16, nb, 16, 2)  # [.., G, n, b, i, pair]
    q = np.moveaxis(q, -4, -2)  # [.., G, b, i, n, pair]
    tiled = (q[..., 0] | (q[..., 1] << 4)).astype(np.uint8).reshape(*lead, n, half)
    order = lambda a: np.ascontiguousarray(np.swapaxes(a.reshape(*lead, g, 16, nb), -1, -2)).reshape(*lead, n, nb)  # noqa: E731
    return TiledQ4(tiled, order(scale), order(offset))


def dequantize(blocks: BlockWeights) -> np.ndarray:
    """The float32 weights [.., N, K] the blocks hold (the arithmetic of gguf's dequantization)."""
    codes = np.asarray(blocks.codes)
    scale = np.asarray(blocks.scale)[..., None]
    *lead, n, width = codes.shape
    if blocks.offset is None:
        q = codes.view(np.int8).reshape(*lead, n, -1, BLOCK).astype(np.float32)
        return (scale * q).reshape(*lead, n, -1)
    c = codes.reshape(*lead, n, -1, BLOCK // 2)
    q = np.concatenate([c & 15, c >> 4], axis=-1).astype(np.float32)
    return (scale * q + np.asarray(blocks.offset)[..., None]).reshape(*lead, n, -1)


def from_gguf(raw: np.ndarray, kind: str) -> BlockWeights:
    """BlockWeights of one GGUF tensor's raw rows (uint8 [N, bytes per row])."""
    if kind not in KINDS:
        raise ValueError(f"GGUF block kind must be one of {KINDS}, got {kind!r}")
    n = raw.shape[0]
    size = 20 if kind == "Q4_1" else 34
    rows = np.ascontiguousarray(raw).reshape(n, -1, size)
    scale = rows[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        return BlockWeights(rows[..., 2:].reshape(n, -1).copy(), scale)
    offset = rows[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return BlockWeights(rows[..., 4:].reshape(n, -1).copy(), scale, offset)


def permute_rows(blocks: BlockWeights, order: np.ndarray) -> BlockWeights:
    return BlockWeights(*(None if a is None else a[order] for a in blocks))


def save_blocks(path: str | Path, blocks: dict[str, BlockWeights]) -> None:
    """`BLOCKS_FILE`: "<tensor name>.codes" / ".scale" / ".offset" per tensor."""
    from safetensors.numpy import save_file

    flat = {f"{name}.{field}": np.ascontiguousarray(a) for name, b in blocks.items()
            for field, a in b._asdict().items() if a is not None}
    save_file(flat, str(path))


def load_blocks(model_dir: str | Path, expected: dict[str, np.ndarray]) -> dict[str, BlockWeights]:
    """The blocks of `model_dir` whose tensor is in `expected` (name -> the float32 weights
    [N, K] the model loaded) and decodes to exactly those bits; {} without a blocks file."""
    from safetensors import safe_open

    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return {}
    found = {}
    with safe_open(path, framework="numpy") as f:
        keys = set(f.keys())
        for name, weights in expected.items():
            if f"{name}.codes" not in keys:
                continue
            offset = f.get_tensor(f"{name}.offset") if f"{name}.offset" in keys else None
            blocks = BlockWeights(f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scale"), offset)
            decoded = dequantize(blocks)
            if decoded.shape == weights.shape and np.array_equal(decoded.view(np.uint32),
                                                                 np.ascontiguousarray(weights, np.float32).view(np.uint32)):
                found[name] = blocks
    return found
