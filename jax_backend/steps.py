"""Jitted step bodies that keep logits on the device: only token ids and accept counts (and,
for the drafter, aux rows that stay on the device) come out.

- `sample_step`: a forward, then one token per logit row (argmax / softmax / top-k-top-p draw,
  `jax_backend.sampling`'s computation, chosen on the host by `sampling_mode`).
- `verify_step`: a forward over blocks [bonus, d_1 .. d_k] (k may differ per sequence; the
  acceptance sees them padded to one width B), then greedy acceptance or
  rejection sampling against the drafts, and the drafter's context features of every block row.

Static arguments: `config`, `aux_layer_ids`, `mode`, `norm_block` (close over them with
functools.partial before jitting; `TargetRunner` does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_backend import greedy_head, model, sampling
from jax_backend.batch import Batch
from jax_backend.config import TargetConfig


def sample_step(
    params: dict,
    kv_pool: jax.Array,
    batch: Batch,
    temperature: jax.Array,  # [R] per logit row
    top_p: jax.Array,
    top_k: jax.Array,
    key: jax.Array | None,
    *,
    config: TargetConfig,
    aux_layer_ids: tuple[int, ...],
    mode: str,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (tokens i32[R], aux [T, n_aux*H], new kv_pool)."""
    if mode == "greedy":  # the argmax of the logits, without all of them where the greedy head runs
        return model.forward(params, config, kv_pool, batch, aux_layer_ids, head=greedy_head.final_tokens)
    logits, aux, kv_pool = model.forward(params, config, kv_pool, batch, aux_layer_ids)
    tokens = sampling.sample_for_mode(logits, temperature, top_p, top_k, key, mode)
    return tokens, aux, kv_pool


def verify_step(
    params: dict,
    kv_pool: jax.Array,
    batch: Batch,
    block_rows: jax.Array,  # i32[S, B]: logit row of block position j of sequence s
    token_rows: jax.Array,  # i32[S, B]: token row of the same
    drafts: jax.Array,  # i32[S, B-1]
    num_drafts: jax.Array,  # i32[S]: drafts sequence s verifies (its block is 1 + num_drafts[s] rows)
    temperature: jax.Array,  # [S*B] per block row (unused when greedy)
    top_p: jax.Array,
    top_k: jax.Array,
    draft_probs: jax.Array | None,  # [S, B-1, V] q, the drafts' distribution (None when greedy)
    key: jax.Array | None,
    *,
    config: TargetConfig,
    aux_layer_ids: tuple[int, ...],
    mode: str,
    norm_block: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns (accepted i32[S], bonus i32[S], features [S, B, n_aux*H], new kv_pool).

    Blocks may be ragged: rows past a sequence's 1 + num_drafts[s] repeat its last row and are
    never accepted. Greedy: the accepted prefix is where the drafts equal the target's argmax (`greedy_accept`);
    otherwise rejection sampling with the target's probabilities p (same transform as q).
    `features` are the drafter's context features of every block row (aux block `norm_block`
    final-normed, as `TargetRunner.hidden_state_features`): a sequence commits rows 0..a.
    """
    if mode == "greedy":
        # The argmax of each logit row (`greedy_head.final_tokens`), then their token ids gathered:
        # gathering [S, B, V] logits first (padding positions repeat rows) doubled the argmax's work.
        tokens, aux, kv_pool = model.forward(params, config, kv_pool, batch, aux_layer_ids, head=greedy_head.final_tokens)
        accepted, bonus = sampling.greedy_accept_tokens(drafts, tokens[block_rows], num_drafts)
    else:
        logits, aux, kv_pool = model.forward(params, config, kv_pool, batch, aux_layer_ids)
        target_logits = logits[block_rows]  # [S, B, V]
        seqs, block, vocab = target_logits.shape
        p = sampling.probs_for_mode(target_logits.reshape(seqs * block, vocab), temperature, top_p, top_k, mode)
        accepted, bonus = sampling.rejection_accept(drafts, draft_probs, p.reshape(seqs, block, vocab), key, num_drafts)
    if norm_block is not None:
        aux = norm_features(aux, params["norm"], norm_block, config)
    return accepted, bonus, aux[token_rows], kv_pool


def norm_features(aux: jax.Array, weight: jax.Array, block: int, config: TargetConfig) -> jax.Array:
    """Apply the final RMSNorm to feature block `block` (columns block*H .. (block+1)*H): the
    last layer's features as transformers reports them (after the final norm)."""
    hidden = config.hidden_size
    columns = slice(block * hidden, (block + 1) * hidden)
    return aux.at[:, columns].set(model.rms_norm(aux[:, columns], weight, config.rms_norm_eps))
