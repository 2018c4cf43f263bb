"""The lm_head as the greedy head kernel reads it (`cpu_kernels.greedy_tokens`): its weights
requantized to int8 with one scale per output, laid out as AMX tiles, with what the kernel needs to
bound how far its approximate logits can be from the exact ones.

A greedy step needs only each row's argmax; the kernel finds it from these tiles (int8 products on
an AMX core, ~32x the float32 FMA rate; with AVX-512 VNNI, whose registers take a tile's 64-byte
rows as they lie, ~4x) and computes exactly only the few logits that may be the largest, so the
tokens are those of the float32 logits (docs/performance.md sections 51-52, 60). The
copy costs a quarter of the float32 head's bytes (SmolLM2: 28 MB, as many as its GGUF Q8_0 blocks).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_backend import model, sampling
from jax_backend.config import TargetConfig

GROUP, CHUNK = 16, 64  # outputs per tile, K per tile


class GreedyHead(NamedTuple):
    packed: jax.Array  # int8 [V/16, K/64, 1024]: tile (g, c) row i, bytes 4n + t = q[16g + n, 64c + 4i + t]
    scale: jax.Array  # float32 [V]: D_v = max|w[v]| / 127, w[v] ~ D_v q[v]
    row_max: jax.Array  # float32 [V]: max |w[v, :]|
    row_err: jax.Array  # float32 [V]: an upper bound on max_i |w[v, i] - D_v q[v, i]|


def fits(w_shape: tuple[int, ...]) -> bool:
    """Whether a [V, K] head has the kernel's tile shape (V % 16 == 0, K % 64 == 0)."""
    return len(w_shape) == 2 and w_shape[0] % GROUP == 0 and w_shape[1] % CHUNK == 0


def attach(params: dict, option: bool | None, cpu_matmul: bool) -> dict:
    """params with a "greedy_head" (`pack` of params["lm_head"]) where a runner's greedy steps take
    their tokens from the kernel (`final_tokens`): `option` None (the default) where the matmul
    kernel runs, the kernel's sums run on AMX tiles or with AVX-512 VNNI
    (`cpu_kernels.greedy_head_fast`) and the head has their shape; True wherever the matmul kernel
    runs and the head has the shape (with neither, the kernel's approximation runs as plain code:
    slow, for tests); False never."""
    from jax_backend import cpu_kernels

    lm_head = params["lm_head"]
    applies = cpu_matmul and lm_head.dtype == jnp.float32 and fits(lm_head.shape)
    if option and not applies:
        raise ValueError(f"greedy_head=True needs the CPU matmul kernel and a float32 lm_head of shape "
                         f"[V % 16 == 0, K % 64 == 0], got {lm_head.dtype} {lm_head.shape}")
    if not applies or option is False or (option is None and not cpu_kernels.greedy_head_fast()):
        return params
    return {**params, "greedy_head": pack(lm_head)}


@jax.jit
def pack(w: jax.Array) -> GreedyHead:
    """The greedy head of float32 weights w [V, K] (`fits`)."""
    v, k = w.shape
    row_max = jnp.max(jnp.abs(w), axis=-1)
    scale = row_max / 127
    q = jnp.clip(jnp.round(w / jnp.where(scale > 0, scale, 1)[:, None]), -127, 127)
    # |w - D q| as float32 computes it, up to 2^-24 of |w| and of |D q| (<= row_max (1 + 2^-23)) each
    err = jnp.max(jnp.abs(w - scale[:, None] * q), axis=-1)
    row_err = err * (1 + 2.0**-20) + row_max * 2.0**-20
    # AMX B tiles: runs of 4 along K, 16 outputs across
    tiles = q.astype(jnp.int8).reshape(v // GROUP, GROUP, k // CHUNK, CHUNK // 4, 4).transpose(0, 2, 3, 1, 4)
    return GreedyHead(tiles.reshape(v // GROUP, k // CHUNK, GROUP * CHUNK), scale, row_max, row_err)


def final_tokens(params: dict, config: TargetConfig, h: jax.Array, rows: jax.Array, vocab_major: bool = False,
                 cpu_kernel: bool = False) -> jax.Array:
    """int32 [R]: `sampling.argmax(model.final_logits(...))` (same arguments), the same tokens; from
    the greedy head kernel where params hold one (`TargetRunner(greedy_head=...)`) and the step's
    rows (at most 64) run the CPU kernels (the kernel's exact logits are theirs). Its int8 copy reads
    as many bytes as the Q8_0 head, so it pays at every row count: real steps ran 0.81-0.94x
    (docs/performance.md section 52)."""
    head = params.get("greedy_head")
    if head is not None and cpu_kernel and rows.shape[0] <= model.CPU_MATMUL_MAX_ROWS:
        from jax_backend import cpu_kernels

        return cpu_kernels.greedy_tokens(model.rms_norm(h[rows], params["norm"], config.rms_norm_eps), params["lm_head"], head)
    return sampling.argmax(model.final_logits(params, config, h, rows, vocab_major, cpu_kernel))


def drafter_tokens(x: jax.Array, arrays: tuple[jax.Array, GreedyHead]) -> jax.Array:
    """`cpu_kernels.greedy_tokens(x, *arrays)`: the drafter's greedy head (`for_drafter`)."""
    from jax_backend import cpu_kernels

    return cpu_kernels.greedy_tokens(x, *arrays)


def for_drafter(params: dict, token_map=None) -> tuple | None:
    """`DFlashProposer(greedy_head=)` for a drafter sharing a runner's lm_head: (drafter_tokens,
    (lm_head, its greedy head)), over the rows of `token_map` where the drafter has one, where the
    runner holds a greedy head (`attach`), else None. The drafter's greedy logits are the matmul
    kernel's products of those rows (the blocks' bits are their float32 values'), so the tokens are
    theirs."""
    if params.get("greedy_head") is None:
        return None
    w = params["lm_head"] if token_map is None else params["lm_head"][jnp.asarray(token_map, jnp.int32)]
    return (drafter_tokens, (w, params["greedy_head"] if token_map is None else pack(w))) if fits(w.shape) else None
