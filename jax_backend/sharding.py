"""Tensor parallelism for the target: a 1-D device mesh and where each array lives on it.

Megatron-style, as MaxText and vllm-project/tpu-inference shard Llama / Qwen3: the mesh has one
axis, "tp", of N devices.
- column-parallel (output features split): q/k/v projections (so attention heads), gate/up (MLP
  columns); row-parallel (input features split): o_proj, down_proj. Each device then runs its
  heads' attention and its MLP columns alone; XLA's SPMD partitioner inserts the all-reduce after
  o_proj and down_proj.
- the KV pool [L, P, page, 2*Hkv, D] is split on its combined-head axis: K/V are interleaved per
  head (even = K, odd = V), so a contiguous 1/N of that axis is whole (K, V) pairs of Hkv/N heads,
  the same heads as the device's q/k/v columns.
- embed / lm_head [V, H] split on the vocabulary (replicated when N does not divide V).
- norms replicated.
Step outputs (logits, tokens, drafter features) come back replicated; the pool keeps its sharding.
No communication is written by hand: shardings go in, XLA partitions the jitted steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_backend.config import TargetConfig

TP_AXIS = "tp"

# Projection weights are stored [in, out] (stacked: [L, in, out]); the split axis counts from the end
# so that the stacked and the unrolled (per-layer) layouts share one table.
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split `out`: axis -1
_ROW_PARALLEL = ("o_proj", "down_proj")  # split `in`: axis -2


class TensorParallelError(ValueError):
    """A tensor-parallel size this model or machine cannot run (the message says why)."""


def check_tp_size(config: TargetConfig, tp_size: int) -> None:
    """Refuse a tp size that does not divide the heads or MLP columns, or exceeds the devices."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    for name, count in (
        ("num_key_value_heads", config.num_key_value_heads),
        ("num_attention_heads", config.num_attention_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if count % tp_size:
            raise TensorParallelError(
                f"tp_size {tp_size} does not divide the target's {name} ({count}): each device must "
                f"hold whole heads and an equal share of the MLP; pick a tp size that divides {count}"
            )
    available = len(jax.devices())
    if tp_size > available:
        raise TensorParallelError(
            f"tp_size {tp_size} needs {tp_size} devices, but JAX sees {available} "
            f"({jax.default_backend()}: {jax.devices()[0].device_kind})"
        )


def make_mesh(tp_size: int) -> Mesh:
    """A 1-D mesh over the first `tp_size` devices (all hosts' devices after jax.distributed)."""
    return Mesh(np.asarray(jax.devices()[:tp_size]), (TP_AXIS,))


def param_spec(name: str, ndim: int, vocab_sharded: bool) -> P:
    """PartitionSpec of the params entry `name` (a layer weight's key or embed / lm_head / norm)."""
    axes: list[Any] = [None] * ndim
    if name in _COLUMN_PARALLEL:
        axes[-1] = TP_AXIS
    elif name in _ROW_PARALLEL:
        axes[-2] = TP_AXIS
    elif name in ("embed", "lm_head") and vocab_sharded:
        axes[0] = TP_AXIS
    elif name in ("qkv_proj", "gate_up_proj"):
        # Fused columns are [q | k | v] / [gate | up]: an even split would not follow the heads.
        raise TensorParallelError("fused projections (fuse_projections=True) cannot be tensor-parallel")
    return P(*axes)


def param_sharding(mesh: Mesh, config: TargetConfig) -> Callable[[str, int], NamedSharding]:
    """(name, ndim) -> NamedSharding of that params entry on `mesh`."""
    vocab_sharded = config.vocab_size % mesh.size == 0
    return lambda name, ndim: NamedSharding(mesh, param_spec(name, ndim, vocab_sharded))


def kv_pool_sharding(mesh: Mesh) -> NamedSharding:
    """The pool [L, P, page, 2*Hkv, D] split on its combined-head axis."""
    return NamedSharding(mesh, P(None, None, None, TP_AXIS, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_step(fn: Callable, mesh: Mesh, free: tuple[int, ...] = ()) -> Callable:
    """Wrap a step body whose LAST output is the new KV pool: the pool keeps `kv_pool_sharding`
    (the donated pool's sharding is the same on every call: no recompilation, in-place update);
    the other outputs are replicated (the host reads them, the drafter takes them as they are),
    except outputs `free`, left where XLA puts them (the forward's logits: split on the
    vocabulary like lm_head; the host gathers them when it reads them; asking for them
    replicated inside the step made XLA all-gather the whole lm_head instead). Across processes
    (multi-host) every output is replicated: a host can only read what its own devices hold."""
    pool, rest = kv_pool_sharding(mesh), replicated(mesh)
    free = () if mesh.is_multi_process else free

    def sharded(*args, **kwargs):
        *outputs, kv_pool = fn(*args, **kwargs)
        outputs = [
            x if i in free else jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, rest), x)
            for i, x in enumerate(outputs)
        ]
        return (*outputs, jax.lax.with_sharding_constraint(kv_pool, pool))

    return sharded


def bytes_per_device(tree: Any) -> dict[str, int]:
    """Bytes each device holds of the arrays in `tree` (each distinct array counted once: a tied
    lm_head is the embed array), from the arrays' addressable shards."""
    totals: dict[str, int] = {}
    seen: set[int] = set()
    for array in jax.tree.leaves(tree):
        if id(array) in seen or not isinstance(array, jax.Array):
            continue
        seen.add(id(array))
        for shard in array.addressable_shards:
            key = str(shard.device)
            totals[key] = totals.get(key, 0) + shard.data.nbytes
    return totals
