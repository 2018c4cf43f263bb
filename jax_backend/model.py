"""Llama / Qwen3 decoder as pure functions over the params pytree and a paged KV pool.

Numerics follow transformers' eager implementation: RMSNorm in float32 cast back to the
activation dtype before the weight multiply, RoPE with the rotate_half convention and cos/sin
computed in float32, attention softmax in float32. By default the layers run under one
`lax.scan` over the stacked layer params, so compile time does not grow with depth (`forward`
names the other layer loops).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_backend.batch import Batch
from jax_backend.config import TargetConfig
from jax_backend.paged_attention import interleave_kv, prefix_block_attention, write_kv


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_inv_freq(config: TargetConfig) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2] (float32), with optional linear/llama3 scaling."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: TargetConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, head_dim] for integer positions [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(config))[None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, D]; HF convention: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def forward(
    params: dict,
    config: TargetConfig,
    kv_pool: jax.Array,
    batch: Batch,
    aux_layer_ids: tuple[int, ...] = (),
    head: Callable | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One packed ragged forward. `config` and `aux_layer_ids` are static (close over them or
    mark them static when jitting).

    kv_pool: [num_layers, num_pages, page_size, 2*Hkv, D] (K even / V odd on axis 3).
    params["layers"]: its layout chooses how the decoder layers run (`LAYER_LOOPS`):
      - a dict of stacked [num_layers, ...] arrays: one `lax.scan` over them ("scan"; compile
        time flat in depth, but each iteration slices its layer's weights out of the stack, and
        XLA:CPU copies those slices before its small-M matmul kernels read them);
      - `LayerBranches` of per-layer dicts (`switch_layers`): one `lax.scan` over the layer
        index whose body is a `lax.switch` with one branch per layer ("switch"; each branch
        reads its own weights where they lie: no per-step weight copies, a longer compile);
      - a list of per-layer dicts (`unstack_layers`): straight-line code ("unrolled"; no loop
        at all, the longest compile; for accelerators).
    Fused "qkv_proj" / "gate_up_proj" weights (`fuse_projections`) replace the separate
    projections when present; a projection stored out-major (name + "_t", `out_major_layers`)
    runs in the orientation `project` picks.
    Returns (logits [R, V] float32 for rows `batch.logits_indices`,
             aux [T, len(aux_layer_ids) * H] = concat of the OUTPUT of each layer l in
             `aux_layer_ids` (the residual stream after layer l, before any final norm; equal to
             transformers' hidden_states[l + 1] for l < num_layers - 1, while for
             l = num_layers - 1 transformers reports the final-normed states instead),
             new kv_pool); `head` (final_logits' arguments) in place of `final_logits`, e.g. the
    greedy steps' `greedy_head.final_tokens`.
    """
    h, aux, new_kv = _layers(params, config, kv_pool, batch, aux_layer_ids)
    slots = batch.slot_mapping
    if isinstance(params["layers"], list):
        # Unrolled, XLA hoists every layer's page gather to the start, where nothing orders it
        # before the in-place write below, and it copies the whole pool (twice) to keep the
        # reads safe. A data edge from h (which every read feeds) to the write's slots orders
        # them; it never fires for finite h (a NaN step sends its writes to scratch page 0).
        slots = jnp.where(jnp.isnan(h[0, 0]), 0, slots)
    # new_kv [L, T, 2*Hkv, D] -> slots; padding rows land in each layer's scratch page 0.
    kv_pool = write_kv(kv_pool, new_kv, slots)
    logits = (head or final_logits)(params, config, h, batch.logits_indices, batch.vocab_major_logits, batch.cpu_matmul)
    return logits, aux, kv_pool


# The widest step whose logits `final_logits` computes vocabulary-major (break-even ~64 rows on CPU).
VOCAB_MAJOR_MAX_ROWS = 64


def final_logits(params: dict, config: TargetConfig, h: jax.Array, rows: jax.Array,
                 vocab_major: bool = False, cpu_kernel: bool = False) -> jax.Array:
    """float32 logits [R, V] of hidden rows `rows` (final norm, then lm_head).

    `vocab_major` (the runner sets it on a CPU): for R > 1 rows compute lm_head @ last.T [V, R]
    and transpose it after an optimization barrier. XLA:CPU otherwise folds the transpose into
    the dot and runs the [R, 576] x [576, V] product 1.4-1.8x slower at R = 4-32 (SmolLM2's
    49,152 x 576 head: 12.7 -> 7.5 ms at R = 8, 22.7 -> 16.8 ms at R = 32; docs/performance.md
    section 22). Past VOCAB_MAJOR_MAX_ROWS rows it is the slower one (1.10x at 128 rows, 1.35x at
    512: a batch-32 verify of 8-token blocks has 256), so wider steps keep the plain dot. Same
    products, another summation order: logits differ by float rounding (<= 3e-5 on SmolLM2's).
    `cpu_kernel` (`Batch.cpu_matmul`): steps of at most CPU_MATMUL_MAX_ROWS float32 rows take
    `cpu_kernels.rows_matmul` instead (lm_head [V, H] is out-major as it is), or for at most
    BLOCKS_MAX_ROWS rows `rows_matmul_blocks` over params["blocks"]["lm_head"] where the loader
    kept the checkpoint's GGUF blocks (the same bits)."""
    last = rms_norm(h[rows], params["norm"], config.rms_norm_eps)
    if _kernel_rows(cpu_kernel, last, params["lm_head"]):
        from jax_backend import cpu_kernels

        head_blocks = params.get("blocks", {}).get("lm_head")
        if head_blocks is not None and last.shape[0] <= BLOCKS_MAX_ROWS:
            return cpu_kernels.rows_matmul_blocks(last, head_blocks)
        return cpu_kernels.rows_matmul(last, params["lm_head"])
    if vocab_major and 1 < last.shape[0] <= VOCAB_MAJOR_MAX_ROWS:
        return jax.lax.optimization_barrier(params["lm_head"] @ last.T).T.astype(jnp.float32)
    return (last @ params["lm_head"].T).astype(jnp.float32)


# The widest step whose projections run the CPU matmul kernel (`project`): it beat XLA's dots at
# every width up to 64 rows (docs/performance.md section 29); prefill chunks keep XLA's GEMM.
CPU_MATMUL_MAX_ROWS = 64


# The widest step whose kernel products read GGUF blocks (`jax_backend.blocks`) rather than the
# float32 weights: decoding costs compute that only few-row products earn back. SmolLM2's shapes,
# weights from memory, blocks / float32 time: on an AMD EPYC 0.24-0.41 at 1 row, 0.52-0.71 at 8,
# 0.79-0.83 at 16, 1.02-1.05 at 32 (section 41, before Q4_1 was decoded by lookup, section 47);
# on an Intel Xeon (AVX-512) 0.43-0.45 at 8, 0.61-0.71 at 16, 0.75-0.83 at 24, 0.79-0.91 at 32,
# 1.07 at 64, and steps of 17-32 rows (batch-32 decode, 8 x 4 verify) 0.84-0.90x (section 49).
# Since 24+ rows decode the blocks into scratch for the float32 tiles (section 50) every kernel step
# reads them: steps of 33-64 rows (8 x 8 and 4 x 16 verify, batch-48 decode) 0.96-0.99x.
BLOCKS_MAX_ROWS = 64


def _kernel_rows(cpu_kernel: bool, x: jax.Array, w: jax.Array) -> bool:
    return cpu_kernel and x.shape[0] <= CPU_MATMUL_MAX_ROWS and x.dtype == w.dtype == jnp.float32


def _reads_blocks(blocks: dict | None, name: str, x: jax.Array) -> bool:
    """A kernel step (`_kernel_rows`) of x reads the stack `name` as blocks."""
    return bool(blocks) and name in blocks and x.shape[0] <= BLOCKS_MAX_ROWS


def project(w: dict, x: jax.Array, name: str, cpu_kernel: bool = False, layer: jax.Array | None = None,
            blocks: dict | None = None, index: jax.Array | int = 0) -> jax.Array:
    """x [T, in] @ the layer's weight `name`. Stored out-major (`out_major_layers`: name + "_t",
    [out, in]), it runs as:
      - the CPU matmul kernel (`cpu_kernel`, `Batch.cpu_matmul`) for T <= CPU_MATMUL_MAX_ROWS
        float32 rows; with `layer` the weight is the whole layer stack [L, out, in], which the
        kernel reads in place (a slice of it would be copied before any custom call reads it);
      - else, T <= VOCAB_MAJOR_MAX_ROWS, w_t @ x.T behind an optimization barrier, transposed
        back, the orientation of `final_logits`: XLA:CPU's kernels run the dots of a 1-32-row
        step 1.2-1.7x faster so (docs/performance.md section 25);
      - else (prefill) x @ w_t.T, as fast as the [in, out] layout there.
    `blocks` (params["blocks"]: GGUF-block stacks, `jax_backend.blocks`) with the layer's `index`:
    kernel steps of at most BLOCKS_MAX_ROWS rows read the weight's blocks (the same bits)."""
    if name in w:
        return x @ w[name]
    w_t = w[name + "_t"]
    if _kernel_rows(cpu_kernel, x, w_t):
        from jax_backend import cpu_kernels

        if _reads_blocks(blocks, name, x):
            return cpu_kernels.rows_matmul_blocks(x, blocks[name], index)
        return cpu_kernels.rows_matmul(x, w_t, layer)
    if layer is not None:
        w_t = w_t[layer]
    if x.shape[0] <= VOCAB_MAJOR_MAX_ROWS:
        return jax.lax.optimization_barrier(w_t @ x.T).T
    return x @ w_t.T


def project_parts(w: dict, x: jax.Array, fused: str, parts: tuple[str, ...], sizes: tuple[int, ...],
                  cpu_kernel: bool = False, layer: jax.Array | None = None, blocks: dict | None = None,
                  index: jax.Array | int = 0) -> list[jax.Array]:
    """The `parts` projections of x (outputs of `sizes`): where `project` would read blocks and the
    loader fused them (`loader.FUSED_BLOCKS`), one kernel call over the `fused` stack, split (the
    same bits: every output is its own sum); else one `project` each."""
    first = w.get(parts[0] + "_t")
    if first is not None and _kernel_rows(cpu_kernel, x, first) and _reads_blocks(blocks, fused, x):
        from jax_backend import cpu_kernels

        y = cpu_kernels.rows_matmul_blocks(x, blocks[fused], index)
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    return [project(w, x, name, cpu_kernel, layer, blocks, index) for name in parts]


def _layers(params, config, kv_pool, batch, aux_layer_ids):
    """Embedding and decoder layers: (h [T, H], aux [T, n_aux*H], new_kv [L, T, 2*Hkv, D])."""
    num_layers, num_pages, page_size, num_combined, head_dim = kv_pool.shape
    num_tokens = batch.tokens.shape[0]
    hidden = config.hidden_size
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    eps = config.rms_norm_eps
    dtype = params["embed"].dtype

    # The pool is only READ inside the layer loop (layer l's pages are rows
    # [l * num_pages, (l + 1) * num_pages) of the flat pool): attention takes the cached prefix
    # from the pages and this step's K/V as arrays, and all new K/V are scattered into the pool
    # once after the loop. Same result as write-then-read paged attention; writing inside the
    # loop made XLA:CPU copy the whole pool per layer for some shapes.
    pool = kv_pool.reshape(num_layers * num_pages, page_size, num_combined, head_dim)
    cos, sin = rope_cos_sin(config, batch.positions, dtype)
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim

    # A scan whose projections run the CPU matmul kernel hands it each stacked weight whole, with
    # the layer index, rather than scanning over slices of the stack (`project`).
    stacked_kernel = batch.cpu_matmul and isinstance(params["layers"], dict) and num_tokens <= CPU_MATMUL_MAX_ROWS
    blocks = params.get("blocks")  # stacks read with the layer index in every layer loop

    def layer(h, w, index):
        where = dict(cpu_kernel=batch.cpu_matmul, layer=index if stacked_kernel else None, blocks=blocks, index=index)
        mm = functools.partial(project, w, **where)
        x = rms_norm(h, w["input_norm"], eps)
        if "qkv_proj" in w or "qkv_proj_t" in w:
            qkv = mm(x, "qkv_proj")
            q, k, v = qkv[:, :q_dim], qkv[:, q_dim : q_dim + kv_dim], qkv[:, q_dim + kv_dim :]
        else:
            q, k, v = project_parts(w, x, "qkv_proj", ("q_proj", "k_proj", "v_proj"), (q_dim, kv_dim, kv_dim), **where)
        q = q.reshape(num_tokens, num_heads, head_dim)
        k = k.reshape(num_tokens, num_kv_heads, head_dim)
        v = v.reshape(num_tokens, num_kv_heads, head_dim)
        if config.qk_norm:
            q = rms_norm(q, w["q_norm"], eps)
            k = rms_norm(k, w["k_norm"], eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        attn = prefix_block_attention(
            q,
            k,
            v,
            pool,
            batch.kv_lens,
            batch.page_indices + index * num_pages,
            batch.cu_q_lens,
            batch.num_seqs,
            sm_scale=head_dim**-0.5,
            max_q_len=batch.max_q_len,
            query_tile=batch.query_tile,
            loop_to_longest=batch.loop_to_longest,
            cpu_kernel=batch.cpu_attention,
        )
        h = h + mm(attn.reshape(num_tokens, q_dim), "o_proj")

        x = rms_norm(h, w["post_norm"], eps)
        if "gate_up_proj" in w or "gate_up_proj_t" in w:
            gate, up = jnp.split(mm(x, "gate_up_proj"), 2, axis=-1)
        else:
            inner = config.intermediate_size
            gate, up = project_parts(w, x, "gate_up_proj", ("gate_proj", "up_proj"), (inner, inner), **where)
        h = h + mm(jax.nn.silu(gate) * up, "down_proj")
        return h, interleave_kv(k, v)

    h = params["embed"][batch.tokens]
    n_aux = len(aux_layer_ids)
    layers = params["layers"]
    if isinstance(layers, list):  # unrolled: static indices, no carry
        outputs, new_kv = [], []
        for index, w in enumerate(layers):
            h, kv = layer(h, w, index)
            outputs.append(h)
            new_kv.append(kv)
        aux = [outputs[l] for l in aux_layer_ids]
        aux = jnp.concatenate(aux, axis=-1) if aux else jnp.zeros((num_tokens, 0), dtype)
        return h, aux, jnp.stack(new_kv)

    # Layer -> aux slot; non-aux layers write to a trash slot (n_aux) that is dropped at the end.
    aux_slot = np.full(num_layers, n_aux, np.int32)
    aux_slot[list(aux_layer_ids)] = np.arange(n_aux, dtype=np.int32)
    aux_slot = jnp.asarray(aux_slot)

    switched = isinstance(layers, LayerBranches)  # branch i closes over layer i's own weights
    branches = [lambda h, w=w, i=i: layer(h, w, i) for i, w in enumerate(layers.layers)] if switched else []

    def scanned(carry, xs):
        h, aux = carry
        w, index = xs
        if stacked_kernel:  # the projections' stacks whole, the layer's other weights sliced
            w = {name: (v if name.endswith("_t") and name[:-2] in PROJECTIONS else v[index]) for name, v in layers.items()}
        h, kv = jax.lax.switch(index, branches, h) if switched else layer(h, w, index)
        if n_aux:
            aux = jax.lax.dynamic_update_index_in_dim(aux, h, aux_slot[index], axis=0)
        return (h, aux), kv

    aux = jnp.zeros((n_aux + 1 if n_aux else 0, num_tokens, hidden), dtype)
    xs = (None if switched or stacked_kernel else layers, jnp.arange(num_layers))
    (h, aux), new_kv = jax.lax.scan(scanned, (h, aux), xs)
    aux = aux[:n_aux].transpose(1, 0, 2).reshape(num_tokens, n_aux * hidden)
    return h, aux, new_kv


LAYER_LOOPS = ("scan", "switch", "unrolled")  # how `forward` runs the decoder layers


@jax.tree_util.register_pytree_node_class
class LayerBranches:
    """Per-layer weight dicts that `forward` runs as one branch each of a `lax.switch` inside a
    scan over the layer index (the "switch" layer loop; `switch_layers`)."""

    def __init__(self, layers):
        self.layers = tuple(layers)

    def tree_flatten(self):
        return self.layers, None

    @classmethod
    def tree_unflatten(cls, _, layers):
        return cls(layers)


def unstack_layers(params: dict) -> dict:
    """params with "layers" as a list of per-layer dicts (the unrolled layout of `forward`)."""
    return {**params, "layers": _per_layer(params["layers"])}


def switch_layers(params: dict) -> dict:
    """params with "layers" as `LayerBranches` (the switch layout of `forward`)."""
    return {**params, "layers": LayerBranches(_per_layer(params["layers"]))}


def layer_layout(params: dict, layer_loop: str) -> dict:
    """params laid out for `layer_loop` (one of `LAYER_LOOPS`; from the stacked layout)."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    if layer_loop == "switch":
        return switch_layers(params)
    return unstack_layers(params) if layer_loop == "unrolled" else params


def _per_layer(layers) -> list[dict]:
    """A list of per-layer weight dicts (copies of the stack's slices: made once, at load)."""
    if isinstance(layers, list):
        return layers
    num_layers = next(iter(layers.values())).shape[0]
    return [{name: w[i] for name, w in layers.items()} for i in range(num_layers)]


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")


def out_major_layers(params: dict) -> dict:
    """params with every projection weight [.., in, out] stored transposed, [.., out, in], under
    name + "_t" (`project`; for a CPU: TargetRunner). Same products, another summation order."""

    def transpose(w: dict) -> dict:
        return {(f"{k}_t" if k in PROJECTIONS else k): (jnp.swapaxes(v, -1, -2) if k in PROJECTIONS else v)
                for k, v in w.items()}

    layers = params["layers"]
    if isinstance(layers, LayerBranches):
        return {**params, "layers": LayerBranches(transpose(w) for w in layers.layers)}
    return {**params, "layers": [transpose(w) for w in layers] if isinstance(layers, list) else transpose(layers)}


def fuse_projections(params: dict) -> dict:
    """params with q/k/v fused into "qkv_proj" [.., H, q+2kv] and gate/up into "gate_up_proj"
    [.., H, 2I] (fewer, wider matmuls; same numbers up to float summation order)."""

    def fuse(w: dict) -> dict:
        w = dict(w)
        t, axis = ("_t", -2) if "q_proj_t" in w else ("", -1)  # out-major weights: [.., out, in]
        w[f"qkv_proj{t}"] = jnp.concatenate([w.pop(f"{n}_proj{t}") for n in "qkv"], axis=axis)
        w[f"gate_up_proj{t}"] = jnp.concatenate([w.pop(f"gate_proj{t}"), w.pop(f"up_proj{t}")], axis=axis)
        return w

    layers = params["layers"]
    if isinstance(layers, LayerBranches):
        return {**params, "layers": LayerBranches(fuse(w) for w in layers.layers)}
    fused = [fuse(w) for w in layers] if isinstance(layers, list) else fuse(layers)
    return {**params, "layers": fused}
