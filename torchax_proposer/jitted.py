"""The drafter's jitted programs, built once per drafter structure and block size."""

from __future__ import annotations

import functools

import jax
import torch

from .config import DFlashConfig
from .dflash2 import build_draft_model
from .dflash2_jax import draft_path
from .cpu_lowering import cache_attention, cpu_attention, few_row_matmul
from .jax_drafter import draft_block, draft_greedy, extend_cache, flush_pending, write_pending


class JittedDrafter:
    """`draft_block` and `extend_cache` jitted for one drafter structure and block size.

    Built around a weightless (meta-device) module: every weight comes in through the params
    pytree, so one instance serves every proposer whose drafter has the same config (see
    `jitted_drafter`), and compiled programs are shared between them. `matmul`: the few-row
    projections' CPU kernel, or None (`cpu_lowering.few_row_matmul`); `attention`: the attention's
    (`cpu_lowering.cpu_attention`); `cached`: a draft's attention over the cache in place
    (`cpu_lowering.cache_attention`); `greedy`: a greedy head kernel for `draft_greedy`, or None.
    """

    def __init__(self, config: DFlashConfig, block_size: int, matmul=None, attention=None, greedy=None, cached=None):
        self.matmul = matmul
        self.attention = attention
        self.cached = cached
        with torch.device("meta"):
            skeleton = build_draft_model(config)
            skeleton.stack_projections()  # the proposer's params hold the stacks (`model_params(stacked=True)`)
        self.num_traces = 0
        self.draft = jax.jit(
            self._counted(functools.partial(draft_block, skeleton, block_size)),
            static_argnames=("read_len", "pending_rows"),
            donate_argnames=("k_cache", "v_cache"),
        )
        if greedy is not None:  # tokens only, from the greedy head kernel
            self.draft_greedy = jax.jit(
                self._counted(functools.partial(draft_greedy, skeleton, block_size, greedy)),
                static_argnames=("read_len", "pending_rows"),
                donate_argnames=("k_cache", "v_cache"),
            )
        if config.is_dflash2:  # the selector's path instead of the argmax
            self.draft_path = jax.jit(
                self._counted(functools.partial(draft_path, skeleton, block_size)),
                static_argnames=("read_len", "pending_rows"),
                donate_argnames=("k_cache", "v_cache"),
            )
        self.extend = jax.jit(
            self._counted(functools.partial(extend_cache, skeleton)), donate_argnames=("k_cache", "v_cache")
        )
        self.flush = jax.jit(
            self._counted(functools.partial(flush_pending, skeleton)), donate_argnames=("k_cache", "v_cache")
        )
        self.write_pending = jax.jit(self._counted(write_pending), donate_argnums=0)

    def _counted(self, fn):
        # Runs only while jax traces, i.e. once per new input signature = once per compilation.
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self.num_traces += 1
            with few_row_matmul(self.matmul), cpu_attention(self.attention), cache_attention(self.cached):
                return fn(*args, **kwargs)

        return traced


@functools.lru_cache(maxsize=16)
def jitted_drafter(config: DFlashConfig, block_size: int, matmul=None, attention=None, greedy=None,
                   cached=None) -> JittedDrafter:
    """The shared `JittedDrafter` for a drafter config (DFlashConfig compares structure only)."""
    return JittedDrafter(config, block_size, matmul, attention, greedy, cached)

