"""The lm_head as the greedy head kernel reads it (`cpu_kernels.greedy_tokens`): its weights in
bfloat16, laid out as AMX tiles, and each row's largest magnitude, from which the kernel bounds how
far a bfloat16 logit can be from the exact one.

A greedy step needs only each row's argmax; the kernel finds it from these tiles (16x the float32
FMA rate on an AMX core) and computes exactly only the few logits that may be the largest, so the
tokens are those of the float32 logits (docs/performance.md section 51). The copy costs half the
float32 head's bytes (SmolLM2: 57 MB).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_backend import model, sampling
from jax_backend.config import TargetConfig

GROUP, CHUNK = 16, 32  # outputs per tile, K per tile


class GreedyHead(NamedTuple):
    packed: jax.Array  # uint16 [V/16, K/32, 512]: tile (g, c) row i, column n = w[16g + n, 32c + 2i + (0, 1)]
    row_max: jax.Array  # float32 [V]: max |w[v, :]|, each logit's bound per unit of ||x||_1


def fits(w_shape: tuple[int, ...]) -> bool:
    """Whether a [V, K] head has the kernel's tile shape (V % 16 == 0, K % 32 == 0)."""
    return len(w_shape) == 2 and w_shape[0] % GROUP == 0 and w_shape[1] % CHUNK == 0


def attach(params: dict, option: bool | None, cpu_matmul: bool) -> dict:
    """params with a "greedy_head" (`pack` of params["lm_head"]) where a runner's greedy steps take
    their tokens from the kernel (`final_tokens`): `option` None (the default) where the matmul
    kernel runs, the CPU runs AMX tiles and the head has their shape; True wherever the matmul
    kernel runs and the head has the shape (without AMX the kernel's approximation runs as plain
    float code: slow, for tests); False never."""
    from jax_backend import cpu_kernels

    lm_head = params["lm_head"]
    applies = cpu_matmul and lm_head.dtype == jnp.float32 and fits(lm_head.shape)
    if option and not applies:
        raise ValueError(f"greedy_head=True needs the CPU matmul kernel and a float32 lm_head of shape "
                         f"[V % 16 == 0, K % 32 == 0], got {lm_head.dtype} {lm_head.shape}")
    if not applies or option is False or (option is None and not cpu_kernels.amx_available()):
        return params
    return {**params, "greedy_head": pack(lm_head)}


@jax.jit
def pack(w: jax.Array) -> GreedyHead:
    """The greedy head of float32 weights w [V, K] (`fits`): bfloat16 rounded to nearest even."""
    v, k = w.shape
    bits = jax.lax.bitcast_convert_type(w.astype(jnp.bfloat16), jnp.uint16)
    # AMX B tiles: pairs along K, 16 outputs across
    tiles = bits.reshape(v // GROUP, GROUP, k // CHUNK, CHUNK // 2, 2).transpose(0, 2, 3, 1, 4)
    return GreedyHead(tiles.reshape(v // GROUP, k // CHUNK, GROUP * CHUNK), jnp.max(jnp.abs(w), axis=-1))


# The fewest rows whose greedy tokens come from the kernel. Below, the float32 head over GGUF Q8_0
# blocks reads half the bytes and the step is bound by reading them: real steps at 1-8 rows ran
# 1.02-1.04x slower with the kernel, at 16-64 rows 0.84-0.97x (docs/performance.md section 51).
MIN_ROWS = 16


def final_tokens(params: dict, config: TargetConfig, h: jax.Array, rows: jax.Array, vocab_major: bool = False,
                 cpu_kernel: bool = False) -> jax.Array:
    """int32 [R]: `sampling.argmax(model.final_logits(...))` (same arguments), the same tokens; from
    the greedy head kernel where params hold one (`TargetRunner(greedy_head=...)`) and the step's
    MIN_ROWS-64 rows run the CPU kernels (the kernel's exact logits are theirs)."""
    head = params.get("greedy_head")
    if head is not None and cpu_kernel and MIN_ROWS <= rows.shape[0] <= model.CPU_MATMUL_MAX_ROWS:
        from jax_backend import cpu_kernels

        return cpu_kernels.greedy_tokens(model.rms_norm(h[rows], params["norm"], config.rms_norm_eps), params["lm_head"], head)
    return sampling.argmax(model.final_logits(params, config, h, rows, vocab_major, cpu_kernel))
