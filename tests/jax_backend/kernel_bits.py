"""Writes the CPU kernels' outputs on fixed inputs to an .npz (argv[1]), for comparing the library
built for one instruction set with another's (`test_cpu_kernel_builds.py`)."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_backend import cpu_kernels, greedy_head
from jax_backend.paged_attention import CPU_KERNEL_MAX_Q_LEN, prefix_block_attention
from tests.jax_backend.test_cpu_kernels import whole_step_case
from tests.jax_backend.test_gguf_blocks import random_blocks

MATMUL_SHAPES = [(1, 576, 576), (3, 1536, 576), (8, 576, 1536), (16, 576, 960), (17, 64, 130), (5, 40, 13)]


def outputs() -> dict[str, np.ndarray]:
    assert cpu_kernels.available()
    rng = np.random.default_rng(0)
    out = {}
    for rows, k, n in MATMUL_SHAPES:
        x, w = rng.standard_normal((rows, k), np.float32), rng.standard_normal((n, k), np.float32)
        out[f"matmul_{rows}x{k}x{n}"] = np.asarray(cpu_kernels.rows_matmul(x, w))
    for rows, kind in [(1, "Q4_1"), (5, "Q8_0"), (12, "Q4_1"), (32, "Q8_0")]:  # decoded in registers / into scratch
        x = rng.standard_normal((rows, 576), np.float32)
        out[f"blocks_{rows}_{kind}"] = np.asarray(cpu_kernels.rows_matmul_blocks(x, random_blocks(rng, (300, 576), kind)))
    x, w = rng.standard_normal((20, 576), np.float32), rng.standard_normal((4096, 576), np.float32) * 0.05
    out["greedy_head_20"] = np.asarray(cpu_kernels.greedy_tokens(x, w, greedy_head.pack(jnp.asarray(w))))
    for heads, kv_heads, head_dim in [(9, 3, 64), (8, 2, 128)]:
        attend = jax.jit(functools.partial(prefix_block_attention, sm_scale=head_dim**-0.5, max_q_len=CPU_KERNEL_MAX_Q_LEN,
                                           chunk_tokens=64, loop_to_longest=True, cpu_kernel=True))
        case = whole_step_case(heads, kv_heads, head_dim)
        out[f"attention_{heads}_{kv_heads}_{head_dim}"] = np.asarray(attend(*map(jnp.asarray, case)))
    return out


if __name__ == "__main__":
    np.savez(sys.argv[1], **outputs(), library=np.array(str(cpu_kernels.build())))
