"""The drafter lowered to JAX through torchax: pure functions over a params pytree, jitted.

The draft KV cache is static: per draft layer, K and V arrays [max_num_seqs, kv_heads,
max_context_len + 1, head_dim]; row r of slot s, head h holds the context K/V of position r of the
sequence in slot s. Head-major, so that a draft's attention reads each head's window as it lies
(the module's [n, T, kv_heads, D] view of it is a transpose XLA folds away); row-major, XLA:CPU
copied the window through a transpose per layer per draft (1.8-2.1 ms a layer at 4,096 rows).
The extra last row is a trash row: padding rows write there, so every write has a fixed shape and
never touches real data. The caches are donated to each call and updated in place.

Shapes are bucketed by the caller (`DFlashProposer`): batch and context rows padded to powers of
two, the cache read window (`read_len`) too, so steady-state decoding reuses a handful of compiled
programs.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torchax.interop import jax_view, torch_view

from .cpu_lowering import _CACHE_ATTENTION, _MATMUL, lowering
from .model import DFlashDraftModel

Params = dict[str, jax.Array]
Cache = list[jax.Array]  # one array per draft layer

JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}


def model_params(model: DFlashDraftModel, stacked: bool = False) -> Params:
    """The module's parameters and buffers as a flat {name: jax array} pytree (dtype preserved).
    `stacked`: first `model.stack_projections()`, so that the pytree holds the stacked weights and
    not the ones they replace (a program traced on a stacked module reads only the stacks)."""
    unused = set(model.stack_projections()) if stacked else set()
    params = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in unused:
            continue
        array = tensor.detach().to("cpu", torch.float32).numpy()
        params[name] = jnp.asarray(array, dtype=JAX_DTYPES[tensor.dtype])
    return params


def bfloat16_linear_weights(model: DFlashDraftModel, params: Params, layout: Callable | None = None) -> Params:
    """`params` with each nn.Linear weight whose float32 values are all bfloat16 numbers (a bf16
    checkpoint's, loaded as float32) held as bfloat16: a `few_row_matmul` kernel reads it so and
    gets the same float32 values from half the bytes (`draft_weights` says where;
    docs/performance.md section 45). `layout`: how that kernel holds a bfloat16 weight (e.g. in
    its AMX tile order; the default: as it is)."""
    linear = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    linear |= {name for name, _ in model.named_buffers() if name.endswith("_stack")}  # `stack_projections`'
    out = dict(params)
    for name in linear & set(params):
        weight = params[name]
        if weight.dtype == jnp.float32 and weight.shape[-1] % 32 == 0:
            narrow = weight.astype(jnp.bfloat16)
            if not bool(jnp.array_equal(narrow.astype(jnp.float32), weight)):
                continue
            try:
                out[name] = narrow if layout is None else layout(narrow)
            except ValueError:  # a shape the kernel's layout does not take: float32 as loaded
                pass
    return out


# Draft steps whose projections have at most this many rows read the bfloat16 weights (`draft_weights`).
NARROW_ROWS = 16


def draft_weights(wide, narrow, rows: int, narrow_rows: int = NARROW_ROWS):
    """The weights a draft step's products of `rows` rows read: `narrow` up to NARROW_ROWS, `wide`
    past it. Narrow: a bf16 checkpoint's projections as bfloat16 (`bfloat16_linear_weights`),
    the head as the target's GGUF blocks (`DFlashProposer(kernel_lm_head=)`): the CPU kernel
    reads fewer bytes (propose at one request, block 2: 0.72x with bfloat16), where wide products
    ran 1.1x slower (32-64 rows: compute-bound, and each weight decoded). Either way the same
    float32 values; a signature's rows are fixed, so each compiles once. A kernel summing bfloat16
    weights on AMX tiles is faster at every row count it takes (`narrow_rows` = FEW_ROWS;
    docs/performance.md section 55)."""
    return narrow if rows <= narrow_rows else wide


def init_draft_cache(model: DFlashDraftModel, max_num_seqs: int, max_context_len: int, dtype) -> tuple[Cache, Cache]:
    config = model.config
    shape = (max_num_seqs, config.num_key_value_heads, max_context_len + 1, config.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731 - one fresh buffer per layer
    return [zeros() for _ in model.layers], [zeros() for _ in model.layers]


def call_model(model: torch.nn.Module, params: Params, *args: Any, **kwargs: Any) -> Any:
    """Runs the torch module on JAX values (inside a trace) and returns JAX values."""
    with lowering():
        out = torch.func.functional_call(model, torch_view(params), torch_view(args), torch_view(kwargs))
    return jax_view(out)


def _write_rows(cache: jax.Array, slots, cache_lens, new_lens, rows: jax.Array) -> jax.Array:
    """cache[slot_i, :, cache_len_i + j] = rows[i, j] ([kv_heads, D]) for j < new_len_i; padding
    goes to the trash row."""
    trash = cache.shape[2] - 1
    j = jnp.arange(rows.shape[1])[None, :]
    positions = jnp.where(j < new_lens[:, None], cache_lens[:, None] + j, trash)
    return cache.at[slots[:, None], :, positions].set(rows.astype(cache.dtype))  # rows [n, C, kv_heads, D]


def extend_cache(
    model: DFlashDraftModel,
    params: Params,
    k_cache: Cache,
    v_cache: Cache,
    features: jax.Array,
    new_lens: jax.Array,
    cache_lens: jax.Array,
    slots: jax.Array,
) -> tuple[Cache, Cache]:
    """Appends context rows (features [n, C, n_aux*H], the first new_lens[i] real) to the cache."""
    positions = cache_lens[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)[None, :]
    _, new_kv = call_model(model, params, features.astype(k_cache[0].dtype), positions)
    k_cache = [_write_rows(c, slots, cache_lens, new_lens, k) for c, (k, _) in zip(k_cache, new_kv)]
    v_cache = [_write_rows(c, slots, cache_lens, new_lens, v) for c, (_, v) in zip(v_cache, new_kv)]
    return k_cache, v_cache


def flush_pending(
    model: DFlashDraftModel,
    params: Params,
    k_cache: Cache,
    v_cache: Cache,
    pending: jax.Array,
    new_lens: jax.Array,
    cache_lens: jax.Array,
    slots: jax.Array,
) -> tuple[Cache, Cache]:
    """`extend_cache` with the rows of the pending pool [max_num_seqs, P, n_aux*H] of `slots`."""
    return extend_cache(model, params, k_cache, v_cache, pending[slots], new_lens, cache_lens, slots)


def write_pending(pending: jax.Array, features: jax.Array, slots: jax.Array, offsets: jax.Array) -> jax.Array:
    """pending[slots[i], offsets[i] + j] = features[i, j] (rows past the pool's P are dropped:
    a padding sequence's offset is P). Rows past a sequence's real count are never read."""
    rows = offsets[:, None] + jnp.arange(features.shape[1])[None, :]
    return pending.at[slots[:, None], rows].set(features.astype(pending.dtype), mode="drop")


def draft_block(
    model: DFlashDraftModel,
    block_size: int,
    params: Params,
    embed: jax.Array,
    lm_head: jax.Array,
    k_cache: Cache,
    v_cache: Cache,
    pending: jax.Array,
    new_lens: jax.Array,
    cache_lens: jax.Array,
    slots: jax.Array,
    bonus_tokens: jax.Array,
    token_map: jax.Array | None = None,
    *,
    read_len: int,
    pending_rows: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, Cache, Cache]:
    """One draft for a batch, appending each sequence's pending context rows on the way.

    pending [max_num_seqs, C, n_aux*H]: the pending pool; pending[slots[i]] holds the context rows
    of sequence i not yet in its cache (first new_lens[i] real);
    cache_lens[i]: rows already in its cache slot slots[i]; read_len >= max(cache_lens + new_lens)
    (unused where the draft reads the cache in place, `reads_cache_in_place`);
    pending_rows >= max(new_lens): the pool rows the step reads (default all C).
    The block [bonus, MASK x (B-1)] sits at positions L .. L+B-1, L = cache_len + new_len.
    Returns (draft tokens [n, B-1] int32, logits [n, B-1, V] float32, confidence [n, B-1]: each
    draft's probability under the drafter's softmax, k_cache, v_cache); the logits are needed
    for the argmax anyway, so returning them costs no extra program.
    With `token_map` [K], `lm_head` holds only those K rows: drafts are mapped back to token ids
    and the logits are over the map ([n, B-1, K]).
    """
    hidden, k_cache, v_cache = draft_hidden(
        model, block_size, params, embed, k_cache, v_cache, pending, new_lens, cache_lens, slots, bonus_tokens,
        read_len=read_len, pending_rows=pending_rows,
    )
    if isinstance(lm_head, jax.Array):
        with lowering():
            logits = model.compute_logits(torch_view(hidden[:, 1:]), torch_view(lm_head.astype(hidden.dtype)))
        logits = jax_view(logits).astype(jnp.float32)
    else:  # the head as the few-row kernel reads it (`DFlashProposer(kernel_lm_head=)`)
        logits = kernel_logits(model.config, hidden[:, 1:], lm_head)
    tokens, confidence = greedy_drafts(logits)
    if token_map is not None:
        tokens = token_map[tokens]
    return tokens, logits, confidence, k_cache, v_cache


def draft_greedy(
    model: DFlashDraftModel, block_size: int, greedy: Callable, params: Params, embed: jax.Array, head: Any,
    k_cache: Cache, v_cache: Cache, pending: jax.Array, new_lens: jax.Array, cache_lens: jax.Array,
    slots: jax.Array, bonus_tokens: jax.Array, token_map: jax.Array | None = None, *, read_len: int,
    pending_rows: int | None = None,
) -> tuple[jax.Array, Cache, Cache]:
    """`draft_block`'s draft tokens alone, for a caller that reads neither logits nor confidence:
    greedy(x [R, H] float32, head) -> int32 [R] gives each row's argmax of its float32 logits
    through the head without computing most of them (the target's greedy head kernel,
    `DFlashProposer(greedy_head=)`; with `token_map`, `head` holds those rows and drafts map back).
    The same tokens as draft_block's where its logits are the kernel's products with no multiplier
    or softcap (the proposer checks)."""
    hidden, k_cache, v_cache = draft_hidden(
        model, block_size, params, embed, k_cache, v_cache, pending, new_lens, cache_lens, slots, bonus_tokens,
        read_len=read_len, pending_rows=pending_rows,
    )
    rows = hidden[:, 1:]
    tokens = greedy(rows.reshape(-1, rows.shape[-1]).astype(jnp.float32), head).reshape(rows.shape[:2])
    return (tokens if token_map is None else token_map[tokens]), k_cache, v_cache


def kernel_logits(config, hidden: jax.Array, head) -> jax.Array:
    """`DFlashDraftModel.compute_logits` of hidden [.., H] with the head in the `few_row_matmul`
    kernel's own form (e.g. the target's GGUF blocks, decoding to its float32 lm_head): the
    kernel's products, then the multiplier and softcap as compute_logits applies them, so the same
    bits as the float32 head through `_few_row_linear`."""
    flat = hidden.reshape(-1, hidden.shape[-1]).astype(jnp.float32)
    logits = _MATMUL.get()(flat, head).reshape(*hidden.shape[:-1], -1) * config.output_multiplier
    softcap = config.final_logit_softcapping
    if softcap is not None and softcap > 0:
        logits = jnp.tanh(logits / softcap) * softcap
    return logits


def greedy_drafts(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(argmax int32, its softmax probability) over the last axis. The argmax is jnp.argmax's
    (the first maximum; the first NaN of a row with one), computed as a max reduction and a min
    over the positions holding it: XLA:CPU's variadic-reduce argmax is ~4x slower. The
    probability of the maximum is 1 / sum(exp(logits - max)), from the same max."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    nan = jnp.isnan(logits)
    is_top = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == top)
    positions = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    tokens = jnp.min(jnp.where(is_top, positions, logits.shape[-1] - 1), axis=-1)
    return tokens, 1.0 / jnp.sum(jnp.exp(logits - top), axis=-1)


def draft_hidden(
    model: DFlashDraftModel,
    block_size: int,
    params: Params,
    embed: jax.Array,
    k_cache: Cache,
    v_cache: Cache,
    pending: jax.Array,
    new_lens: jax.Array,
    cache_lens: jax.Array,
    slots: jax.Array,
    bonus_tokens: jax.Array,
    *,
    read_len: int,
    pending_rows: int | None = None,
) -> tuple[jax.Array, Cache, Cache]:
    """The drafter pass of `draft_block`: final-normed hidden states [n, B, H] of the blocks,
    and the caches with the pending rows appended. What turns them into drafts is the caller's
    (DFlash 1: argmax of the logits; DFlash 2: the selector's path, see dflash2_jax.py).

    Order matters for speed: the pending rows are written into the caches FIRST and the
    attention window is then read from the written caches. Reading the donated caches before
    writing them made XLA copy both whole caches (max_num_seqs x max_context_len rows) twice per
    call to protect the read from the in-place write: ~0.5 s at the default context of 8192.
    """
    dtype = k_cache[0].dtype
    # Only the first pending_rows rows of each pool row: every pool row is projected through the
    # drafter's fc and K/V weights, and at 32 requests a pool 8 rows wide where at most 2 were
    # real cost the adaptive worker's draft ~6 ms of ~50 (docs/adaptive.md).
    features = pending[slots, :pending_rows].astype(dtype)
    k_cache, v_cache = extend_cache(model, params, k_cache, v_cache, features, new_lens, cache_lens, slots)

    batch = features.shape[0]
    committed = cache_lens + new_lens
    block_positions = committed[:, None] + jnp.arange(block_size, dtype=jnp.int32)[None, :]
    mask_ids = jnp.full((batch, block_size - 1), model.mask_token_id, jnp.int32)
    block_ids = jnp.concatenate([bonus_tokens[:, None].astype(jnp.int32), mask_ids], axis=1)

    attention = _cached_attention(model, k_cache, v_cache, slots, committed)
    if attention is None:
        # The module's [n, T, kv_heads, D] view of each head-major window (no copy: its attention
        # transposes back).
        past_kv = [(k[slots, :, :read_len].swapaxes(1, 2), v[slots, :, :read_len].swapaxes(1, 2))
                   for k, v in zip(k_cache, v_cache)]
        key_valid = jnp.arange(read_len)[None, :] < committed[:, None]
    else:  # the kernel reads each layer's cache in place: no window
        empty = jnp.zeros((batch, 0, *k_cache[0].shape[1::2]), dtype)
        past_kv, key_valid = [(empty, empty) for _ in k_cache], jnp.zeros((batch, 0), jnp.bool_)
    no_rows = jnp.zeros((batch, 0, features.shape[2]), dtype)  # every context row is in past_kv
    with lowering():
        noise = model.embed_block(torch_view(block_ids), torch_view(embed.astype(dtype)))
    hidden, _ = call_model(
        model,
        params,
        no_rows,
        jnp.zeros((batch, 0), jnp.int32),
        noise_embedding=jax_view(noise),
        block_positions=block_positions,
        past_kv=past_kv,
        key_valid=key_valid,
        attention=attention,
    )
    return hidden, k_cache, v_cache


def reads_cache_in_place(config, dtype, kernel: Callable | None) -> bool:
    """Whether a draft with this cache dtype and `cpu_lowering.cache_attention` kernel attends over
    the cache in place (then `read_len` goes unused: no window is gathered)."""
    full = all(kind == (False, None) for kind in config.layer_attention)
    return kernel is not None and full and dtype == jnp.float32 and config.head_dim in (64, 128)


def _cached_attention(model: DFlashDraftModel, k_cache: Cache, v_cache: Cache, slots, committed) -> Callable | None:
    """The module's `attention` through `cpu_lowering.cache_attention`'s kernel, reading layer i's
    cache rows 0 .. committed[j] - 1 of slot slots[j] in place, then the block: where a kernel is
    set and every layer is full, non-causal attention over float32 heads of 64 or 128 (a window
    the program gathered next to the block cost a copy per layer, K and V, growing with the
    context: docs/performance.md section 59). Else None (`attend` over the gathered window)."""
    kernel = _CACHE_ATTENTION.get()
    if not reads_cache_in_place(model.config, k_cache[0].dtype, kernel):
        return None

    # Called by the module with JAX arrays (`call_model` hands it over through torch_view). The
    # queries folded as `model.attend` folds them: each kv head's query groups as its rows.
    def attention(module, q, segments, mask, scale):
        (past, _), (new, _), (k, v) = segments  # past and new context rows: empty placeholders
        if past.shape[1] or new.shape[1]:
            raise ValueError("cache attention: the context rows must all be in the cache")
        n, length, heads, dim = q.shape
        kv_heads = k.shape[2]
        groups = heads // kv_heads
        folded = q.reshape(n, length, kv_heads, groups, dim).transpose(0, 2, 3, 1, 4).reshape(n, kv_heads, -1, dim)
        i = module.layer_idx
        out = kernel(folded, k_cache[i], v_cache[i], slots, committed, k.swapaxes(1, 2), v.swapaxes(1, 2), scale=scale)
        return out.reshape(n, kv_heads, groups, length, dim).transpose(0, 3, 1, 2, 4).reshape(q.shape)

    return attention


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def as_numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy / jax / torch array (torch tensors are moved to the CPU)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(x)


class DraftPath(NamedTuple):
    """`DFlashProposer.propose_path`'s result for n sequences (numpy, on the host)."""

    tokens: np.ndarray  # int32 [n, B-1]: the drafts (the path)
    candidates: np.ndarray  # int32 [n, B-1, K]: each position's top-K token ids
    probs: np.ndarray | None  # float32 [n, B-1, K]: q over the candidates when sampling


def replicated_over(array: Any) -> jax.sharding.NamedSharding | None:
    """Replicated placement over `array`'s device mesh when it spans several devices, else None."""
    sharding = getattr(array, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return None
