"""`DFlashDraftModel`: the DFlash drafter as a plain PyTorch module with z-lab parameter names.

Written with ordinary torch ops only, so the same module runs in torch eager (any device) and,
through torchax, inside a jitted JAX function (params passed as a pytree).

How a draft is computed (one block of B tokens per sequence):
  ctx   = hidden_norm(fc(context features))           the target's hidden states, projected once
  each layer: queries come from the block only; keys/values are
        [past context K/V ‖ K/V of the new context rows ‖ K/V of the block]
  ("KV injection": every layer projects the same `ctx` with its own k_proj / v_proj.)
Full-attention layers are non-causal: every block token sees the whole context and the whole
block. The context K/V of a row never changes once computed, so callers keep them in a cache and
only pass the rows that are new since the last call.

`stack_projections()` (the JAX proposer's) adds buffers that stack the weights of projections
reading the same input: each layer's q/k/v and gate/up, and every layer's context k/v. The forward
then runs one product per stack: each output is the same dot product as before, one kernel call
instead of several (on a CPU a few-row product's call costs about as much as its bytes).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN

from .config import DFlashConfig

KV = tuple[torch.Tensor, torch.Tensor]  # (keys, values), each [batch, length, kv_heads, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype (as Qwen3 does), scale in the model dtype.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, length, heads, head_dim]; cos/sin [batch, length, head_dim]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.register_buffer("qkv_stack", None, persistent=False)  # [q; k; v] weights (`stack_projections`)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_proj(x), k_proj(x), v_proj(x): one product where the weights are stacked."""
        if self.qkv_stack is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.num_kv_heads * self.head_dim
        return F.linear(x, self.qkv_stack).split([self.num_heads * self.head_dim, kv, kv], dim=-1)

    def key_value(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """Roped, normed keys and values from k_proj(x), v_proj(x) [batch, length, kv_heads * head_dim]."""
        batch, length, _ = k.shape
        k = self.k_norm(k.view(batch, length, self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), v.view(batch, length, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: list[KV],
        mask: torch.Tensor | None,
        attention=None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.project(x)
        q = apply_rope(self.q_norm(q.view(batch, length, self.num_heads, self.head_dim)), cos, sin)
        segments = [*context_kv, self.key_value(k, v, cos, sin)]
        if attention is None:
            out = attend(q, segments, mask, self.head_dim**-0.5)
        else:  # a caller's attention (`DFlashDraftModel.forward`)
            out = attention(self, q, segments, mask, self.head_dim**-0.5)
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))


def attend(q: torch.Tensor, segments: list[KV], mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention of q [n, L, heads, D] over the keys of consecutive segments (one softmax
    across all): segments [(K, V) [n, T_i, kv_heads, D]], mask [n, 1, L or 1, sum T_i] bool (True
    = may attend) or None. Returns [n, L, heads, D].

    Grouped-query attention as torch's `enable_gqa` defines it (query head j reads kv head
    j // groups), with each kv head's query groups folded into its query rows instead: K and V
    are never repeated per query head. Lowered through torchax to XLA:CPU, `enable_gqa` copied
    the cached window once per query head (a batch-8 draft of block 2 over 512 cached rows:
    37 -> 17 ms); in torch eager the folded call runs the same fused kernel, bit for bit.
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = segments[0][0].shape[2]
    groups = heads // kv_heads
    # Each segment head-major before the concatenation: a cached window that is a transposed view
    # of head-major storage (the JAX drafter's cache) is then read as it lies.
    keys = torch.cat([k.transpose(1, 2) for k, _ in segments], dim=2)  # [n, kv_heads, T, D]
    values = torch.cat([v.transpose(1, 2) for _, v in segments], dim=2)
    folded = q.view(batch, length, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(batch, kv_heads, groups * length, head_dim)
    if mask is not None and mask.shape[2] != 1:  # one mask row for every query row broadcasts as it is
        mask = mask[:, :, None].expand(-1, -1, groups, length, -1).reshape(mask.shape[0], 1, groups * length, -1)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.view(batch, kv_heads, groups, length, head_dim).permute(0, 3, 1, 2, 4).reshape(q.shape)


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]
        self.register_buffer("gate_up_stack", None, persistent=False)  # [gate; up] weights (`stack_projections`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_stack is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = F.linear(x, self.gate_up_stack).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)
        # DFlash 2 sets both to a `GroupedDynamicCausalConv` (torchax_proposer/dflash2.py).
        self.attention_conv: nn.Module | None = None
        self.mlp_conv: nn.Module | None = None

    def forward(
        self, h, cos, sin, context_kv: list[KV], mask: torch.Tensor | None, block_len: int | None = None,
        attention=None,
    ) -> torch.Tensor:
        sublayer = lambda x: self.self_attn(x, cos, sin, context_kv, mask, attention)  # noqa: E731
        h = h + _around(self.attention_conv, sublayer, self.input_layernorm(h), block_len)
        return h + _around(self.mlp_conv, self.mlp, self.post_attention_layernorm(h), block_len)


def _around(conv: nn.Module | None, sublayer, x: torch.Tensor, block_len: int | None) -> torch.Tensor:
    """sublayer(x) (DFlash 1), or DFlash 2's convolution on each side of it: the input side's
    dynamic kernel and the output side's both come from the sublayer's input x."""
    if conv is None:
        return sublayer(x)
    x, output_kernel = conv.prepare(x, block_len)
    return conv.finish(sublayer(x), output_kernel, block_len)


class DFlashDraftModel(nn.Module):
    """Parameter names match z-lab checkpoints: `fc`, `hidden_norm`, `norm`, `layers.{i}.*`."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.num_context_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("context_kv_stack", None, persistent=False)  # every layer's [k; v] weights
        self.reset_rope()

    def stack_projections(self) -> list[str]:
        """Stacks the weights of the projections that read the same input into buffers (named
        `*_stack`), which the forward then uses: each layer's [q; k; v] (without biases only) and
        [gate; up], and [k_0; v_0; k_1; v_1; ..] for the context rows, which every layer projects.
        Returns the names of the weights the forward no longer reads (a JAX caller leaves them out
        of its params pytree)."""
        unused = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            mlp.gate_up_stack = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            unused += [f"layers.{i}.mlp.gate_proj.weight", f"layers.{i}.mlp.up_proj.weight"]
            if not self.config.attention_bias:
                attn.qkv_stack = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
                unused += [f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        if not self.config.attention_bias:
            attns = [layer.self_attn for layer in self.layers]
            self.context_kv_stack = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)]).detach()
        return unused

    def context_key_values(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[KV]:
        """Per layer, the roped, normed keys and the values of the context rows ctx [n, C, hidden]."""
        attns = [layer.self_attn for layer in self.layers]
        if self.context_kv_stack is None:
            raw = [(a.k_proj(ctx), a.v_proj(ctx)) for a in attns]
        else:
            parts = F.linear(ctx, self.context_kv_stack).chunk(2 * len(attns), dim=-1)
            raw = list(zip(parts[0::2], parts[1::2]))
        return [a.key_value(k, v, cos, sin) for a, (k, v) in zip(attns, raw)]

    def reset_rope(self) -> None:
        """(Re)computes the RoPE buffers (not part of checkpoints). Buffers, not Python floats, so
        that every number the forward uses travels in the params pytree."""
        inv_freq, scaling = self.config.rope_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("rope_scaling", torch.tensor(scaling, dtype=torch.float32), persistent=False)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [batch, length, head_dim] for integer positions [batch, length]."""
        freqs = positions[..., None].to(torch.float32) * self.inv_freq.to(torch.float32)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.rope_scaling
        sin = angles.sin() * self.rope_scaling
        return cos.to(dtype), sin.to(dtype)

    def embed_block(self, block_ids: torch.Tensor, target_embed: torch.Tensor) -> torch.Tensor:
        """The block's input: the TARGET's embedding of [bonus, MASK, ...] times the configured scale."""
        return F.embedding(block_ids, target_embed) * self.config.input_embedding_scale

    def compute_logits(self, hidden: torch.Tensor, target_lm_head: torch.Tensor) -> torch.Tensor:
        """Draft logits through the TARGET's lm_head [V, H], with the configured multiplier/softcap."""
        logits = F.linear(hidden, target_lm_head) * self.config.output_multiplier
        softcap = self.config.final_logit_softcapping
        if softcap is not None and softcap > 0:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def forward(
        self,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
        noise_embedding: torch.Tensor | None = None,
        block_positions: torch.Tensor | None = None,
        past_kv: list[KV] | None = None,
        key_valid: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        block_len: int | None = None,
        attention=None,
    ) -> tuple[torch.Tensor | None, list[KV]]:
        """One drafter pass.

        context_features  [n, C, n_aux*H]  target hidden states of the C context rows new since
                                            `past_kv` (may be padding, see `key_valid`)
        context_positions [n, C]            their positions
        noise_embedding   [n, B, H]         embedded block (see `embed_block`); None = only
                                            project the new context rows (no block pass)
        block_positions   [n, B]            positions of the block tokens
        past_kv           per layer (K, V) [n, T, kv_heads, head_dim] of context positions 0..T-1
        key_valid         [n, T + C] bool  which past/new context rows exist (None = all)
        attention_mask    [n, 1, B, T + C + B] bool, ANDed with the masks above (None = none):
                                            lets training pack several blocks into one row, each
                                            seeing only its own context prefix and its own block
        block_len         length of each block packed in a row of noise_embedding (None: the row
                                            is one block); DFlash 2's convolutions stop at block edges
        attention         None: `attend`; else attention(module, q, segments, mask, scale) in its
                                            place, per layer (module: the layer's DFlashAttention,
                                            its `layer_idx`), e.g. a kernel that reads the past keys
                                            from a cache the caller holds (then `past_kv` may be
                                            empty placeholders)

        Returns (final-normed hidden states [n, B, H] or None, per layer (K, V) of the new rows).
        """
        ctx = self.hidden_norm(self.fc(context_features))
        ctx_cos, ctx_sin = self.rope(context_positions, ctx.dtype)
        new_kv = self.context_key_values(ctx, ctx_cos, ctx_sin)
        if noise_embedding is None:
            return None, new_kv

        if past_kv is not None:
            context_kv = [[past, new] for past, new in zip(past_kv, new_kv)]
        else:
            context_kv = [[new] for new in new_kv]
        num_past = 0 if past_kv is None else past_kv[0][0].shape[1]
        masks = _LayerMasks(context_positions, block_positions, num_past, key_valid, attention_mask)

        h = noise_embedding
        cos, sin = self.rope(block_positions, h.dtype)
        for layer, kv, kind in zip(self.layers, context_kv, self.config.layer_attention):
            h = layer(h, cos, sin, kv, masks.get(*kind), block_len, attention)
        return self.norm(h), new_kv


class _LayerMasks:
    """Attention masks [n, 1, B, keys] per (is_causal, sliding_window) kind, built once per pass.

    Keys are [past (positions 0..T-1) ‖ new context ‖ block]. A full non-causal layer with every
    key valid gets no mask at all (the common case, and exactly the reference's computation).
    """

    def __init__(self, context_positions, block_positions, num_past, key_valid, extra_mask=None):
        batch = block_positions.shape[0]
        past_positions = torch.arange(num_past, device=block_positions.device, dtype=block_positions.dtype)
        self.key_positions = torch.cat(
            [past_positions.expand(batch, num_past), context_positions.to(block_positions.dtype), block_positions], 1
        )
        self.query_positions = block_positions
        self.valid = None
        if key_valid is not None:
            block_valid = torch.ones_like(block_positions, dtype=torch.bool)
            self.valid = torch.cat([key_valid, block_valid], 1)[:, None, None, :]
        self.extra_mask = extra_mask
        self.cache: dict[tuple[bool, int | None], torch.Tensor | None] = {}

    def get(self, causal: bool, window: int | None) -> torch.Tensor | None:
        kind = (causal, window)
        if kind not in self.cache:
            mask = self._build(causal, window)
            if self.extra_mask is not None:
                mask = self.extra_mask if mask is None else mask & self.extra_mask
            self.cache[kind] = mask
        return self.cache[kind]

    def _build(self, causal: bool, window: int | None) -> torch.Tensor | None:
        if not causal and window is None:
            return self.valid
        query = self.query_positions[:, None, :, None]
        key = self.key_positions[:, None, None, :]
        visible = torch.ones_like(query == key)
        if causal:
            visible = visible & (key <= query)
        if window is not None:
            visible = visible & (query - key < window)
            if not causal:
                visible = visible & (key - query < window)
        return visible if self.valid is None else visible & self.valid
