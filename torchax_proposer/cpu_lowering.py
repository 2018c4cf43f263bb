"""How the drafter's torch code lowers to XLA on a CPU: its float32 projections of few rows weight-first
or through a matmul kernel the caller chooses, its attention keys-first or through an attention
kernel the caller chooses (this package imports no kernels: the DFLASH worker hands it the target's,
`jax_backend.cpu_kernels`). Elsewhere (TPU, GPU) torchax's own lowerings run unchanged."""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import torch
import torchax
from torchax.ops import ops_registry

# On a CPU, a projection of at most this many rows runs weight-first (`_few_row_linear`).
FEW_ROWS = 64
_LOWERING = threading.RLock()
_MATMUL: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("few_row_matmul", default=None)
_ATTENTION: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("cpu_attention", default=None)
_CACHE_ATTENTION: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("cache_attention", default=None)


@contextlib.contextmanager
def few_row_matmul(matmul: Callable | None) -> Iterator[None]:
    """Drafter code traced inside lowers its float32 projections of at most FEW_ROWS rows on a
    CPU to matmul(x [R, K], w [N, K]) -> x @ w.T [R, N] (a CPU kernel; the caller chooses one:
    this package imports no kernels). None: XLA's dot, weight-first."""
    token = _MATMUL.set(matmul)
    try:
        yield
    finally:
        _MATMUL.reset(token)


@contextlib.contextmanager
def cpu_attention(attention: Callable | None) -> Iterator[None]:
    """Drafter code traced inside lowers its float32 attention on a CPU (head size 64 or 128, a
    boolean mask [N, 1, 1 or R, S] or none) to attention(query, key, value, attn_mask, scale=)
    with F.scaled_dot_product_attention's meaning (a CPU kernel the caller chooses, like
    `few_row_matmul`). None: `_keys_first_attention`, XLA's ops."""
    token = _ATTENTION.set(attention)
    try:
        yield
    finally:
        _ATTENTION.reset(token)


@contextlib.contextmanager
def cache_attention(attention: Callable | None) -> Iterator[None]:
    """A draft traced inside attends over the drafter's cache in place through attention(query,
    k_cache, v_cache, slots, lens, k_block, v_block, scale=) (a CPU kernel the caller chooses,
    e.g. `jax_backend.cpu_kernels.cache_attention`), where its layers allow it
    (`jax_drafter.draft_hidden`). None: the cached window is gathered next to the block."""
    token = _CACHE_ATTENTION.set(attention)
    try:
        yield
    finally:
        _CACHE_ATTENTION.reset(token)


def _few_row_linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """F.linear (x @ W.T, W [out, in] as torch stores it) for XLA:CPU: up to FEW_ROWS rows as
    (W @ x.T).T, the weight the dot's left operand, behind an optimization barrier that keeps XLA
    from turning it back. XLA:CPU's few-row dots read a right-hand weight at 4-9 GB/s (docs/
    performance.md section 23); weight-first, `propose` at batch 1 ran 0.70-0.76x as long, the
    same drafts (section 26; the target's projections do the same, `jax_backend.model.project`)."""
    rows = math.prod(x.shape[:-1])
    matmul = _MATMUL.get()
    if rows > FEW_ROWS:
        y = x @ weight.T
    elif matmul is not None and x.dtype == jnp.float32 and weight.dtype in (jnp.float32, jnp.bfloat16):
        y = matmul(x.reshape(rows, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])
    else:
        y = jax.lax.optimization_barrier(weight @ x.reshape(rows, x.shape[-1]).T).T
        y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _keys_first_attention(query: jax.Array, key: jax.Array, value: jax.Array, attn_mask: jax.Array | None = None,
                          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                          enable_gqa: bool = False) -> jax.Array:
    """F.scaled_dot_product_attention for XLA:CPU with the keys [.., S, D] as the scores' left
    operand: scores are computed transposed, [.., S, L], and the softmax runs over S. torchax's
    lowering computes query @ key.T, and XLA:CPU wrote every layer's key window transposed
    (with the cache gather fused in, ~4 ns an element: 0.8 ms a layer at 1,024 cached rows)
    before the dot; here only the small [S, L] probabilities are transposed, for their dot with
    the values."""
    if dropout_p or is_causal or enable_gqa:
        raise ValueError("the drafter's CPU attention takes neither dropout, is_causal nor enable_gqa")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = jnp.einsum("...sd,...ld->...sl", key, query) * scale
    if attn_mask is not None:
        mask = jnp.swapaxes(attn_mask, -1, -2)
        scores = jnp.where(mask, scores, -jnp.inf) if mask.dtype == jnp.bool_ else scores + mask
    probs = jax.nn.softmax(scores, axis=-2)
    return jnp.einsum("...sl,...sd->...ld", probs, value)


def _attention(query: jax.Array, key: jax.Array, value: jax.Array, attn_mask: jax.Array | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> jax.Array:
    """F.scaled_dot_product_attention on a CPU: `cpu_attention`'s kernel where it takes the call
    (it reads each allowed key once in place and never materializes the scores: XLA's scores,
    masking, softmax and probability-value dot were ~1 ms of a 3-4 ms draft at one request,
    docs/performance.md section 48), else `_keys_first_attention`."""
    kernel = _ATTENTION.get()
    if kernel is not None and not (dropout_p or is_causal or enable_gqa) and _kernel_takes(query, key, value, attn_mask):
        return kernel(query, key, value, attn_mask, scale=query.shape[-1] ** -0.5 if scale is None else scale)
    return _keys_first_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _kernel_takes(query, key, value, attn_mask) -> bool:
    """Whether `cpu_attention`'s kernel computes this attention: float32 4-d operands of head
    size 64 or 128, one head count, and a boolean mask [N, 1, 1 or R, S] or none."""
    if any(a.dtype != jnp.float32 or a.ndim != 4 for a in (query, key, value)) or query.shape[-1] not in (64, 128):
        return False
    if key.shape[:2] != query.shape[:2] or value.shape != key.shape:
        return False
    if attn_mask is None:
        return True
    n, _, rows, _ = query.shape
    return (attn_mask.dtype == jnp.bool_ and attn_mask.ndim == 4 and attn_mask.shape[0] in (1, n)
            and attn_mask.shape[1] == 1 and attn_mask.shape[2] in (1, rows) and attn_mask.shape[3] == key.shape[2])


@contextlib.contextmanager
def lowering() -> Iterator[None]:
    """torchax's default environment while the drafter is traced, on a CPU with F.linear lowered
    by `_few_row_linear` and F.scaled_dot_product_attention by `_attention` (restored
    after: other torchax code in the process is left alone)."""
    env = torchax.default_env()
    if jax.default_backend() != "cpu":
        with env:
            yield
        return
    lowerings = {
        torch.nn.functional.linear: _few_row_linear,
        torch.ops.aten.linear: _few_row_linear,
        torch.nn.functional.scaled_dot_product_attention: _attention,
        torch.ops.aten.scaled_dot_product_attention: _attention,
    }
    with _LOWERING:  # one thread at a time swaps the shared environment's lowering
        saved = {key: env._ops[key] for key in lowerings}  # torchax keeps its lowerings in this dict
        for key, function in lowerings.items():
            env._ops[key] = ops_registry.Operator(key, function, is_jax_function=True, is_user_defined=True,
                                                  needs_env=False, is_view_op=False)
        try:
            with env:
                yield
        finally:
            env._ops.update(saved)
