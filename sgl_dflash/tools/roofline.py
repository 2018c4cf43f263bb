"""The roofline arithmetic of the benchmarks (`bench_roofline`, `bench_dflash --roofline`): this
machine's read bandwidth and fp32 matmul peak as XLA achieves them, and a step's bytes, FLOPs and
roofline time, max(bytes / bandwidth, FLOPs / peak)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jax_backend import TargetRunner, greedy_head
from jax_backend.loader import FUSED_BLOCKS
from jax_backend.model import BLOCKS_MAX_ROWS, CPU_MATMUL_MAX_ROWS


# -- the machine ----------------------------------------------------------------------------------
def _best_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def measure_machine(on_gpu: bool) -> dict:
    """Read bandwidth (GB/s) and fp32 matmul peak (GFLOP/s) as XLA achieves them here."""
    nbytes = (2 << 30) if on_gpu else (512 << 20)
    data = jnp.ones(nbytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    bandwidth = nbytes / _best_seconds(lambda: total(data), 10) / 1e9
    del data
    n = 8192 if on_gpu else 1024
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    peak = 2 * n**3 / _best_seconds(lambda: matmul(a, a), 10) / 1e9
    return {"read_bandwidth_gbs": bandwidth, "matmul_fp32_gflops": peak, "bandwidth_bytes": nbytes, "matmul_n": n}


def roofline(config, params_bytes: int, batch: int, k: int, context: int, machine: dict,
             extra_bytes: int = 0) -> dict:
    """Bytes, FLOPs and the roofline time of one step (B sequences, K new tokens each);
    `extra_bytes`: read besides the target's (a DFLASH step's drafter weights)."""
    L, H, D = config.num_hidden_layers, config.hidden_size, config.head_dim
    hq, hkv, inter, vocab = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.vocab_size
    kv_token = 2 * L * hkv * D * 4
    tokens, logit_rows = batch * k, batch * (k if k > 1 else 1)
    layer_matmul = H * (hq * D + 2 * hkv * D) + hq * D * H + 3 * H * inter
    flops = 2 * tokens * L * layer_matmul + 2 * logit_rows * vocab * H
    flops += 4 * L * hq * D * batch * (k * context + k * (k + 1) // 2)  # scores + weighted sum
    nbytes = params_bytes + batch * context * kv_token + tokens * kv_token + extra_bytes
    memory_s = nbytes / (machine["read_bandwidth_gbs"] * 1e9)
    compute_s = flops / (machine["matmul_fp32_gflops"] * 1e9)
    return {"bytes": nbytes, "flops": flops, "roofline_ms": max(memory_s, compute_s) * 1e3,
            "bound": "memory" if memory_s >= compute_s else "compute"}


def target_bytes(runner: TargetRunner) -> int:
    """Bytes of the target's float32 weights (a tied lm_head is one array, counted twice in the
    tree; GGUF blocks and the greedy head's int8 tiles kept beside them are not counted)."""
    params = {name: value for name, value in runner.params.items() if name not in ("blocks", "greedy_head")}
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    return nbytes - (params["lm_head"].nbytes if runner.config.tie_word_embeddings else 0)


def weight_bytes_read(runner: TargetRunner, rows: int) -> int:
    """Bytes of weights a (greedy) step of `rows` rows reads: `target_bytes`, except that the
    kernel's few-row products read the GGUF blocks of the weights that have them
    (`model.BLOCKS_MAX_ROWS`), and the greedy head's steps (up to 64 rows) its int8 tiles in place
    of the lm_head."""
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    total, blocks = target_bytes(runner), runner.params.get("blocks", {})
    with_blocks = runner.cpu_matmul and blocks and rows <= BLOCKS_MAX_ROWS
    if with_blocks:
        layers = runner.params["layers"]
        parts = [part for name in blocks for part in FUSED_BLOCKS.get(name, (name,))]  # a fused stack's parts
        total += nbytes(blocks) - sum(nbytes(runner.params["lm_head"] if name == "lm_head" else layers[f"{name}_t"])
                                      for name in parts)
    head = runner.params.get("greedy_head")
    if head is not None and rows <= CPU_MATMUL_MAX_ROWS:
        total += nbytes(head) - nbytes(blocks["lm_head"] if with_blocks and "lm_head" in blocks else runner.params["lm_head"])
    return total
