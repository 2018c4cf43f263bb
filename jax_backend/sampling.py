"""Sampling and speculative acceptance as jitted functions (per-row parameters as arrays).

`probs` is the single temperature / top-k / top-p transform used for target and draft alike;
its semantics match `dflash.model._sampling_probs`: divide by temperature, keep the top_k
scores (when 0 < top_k < V), softmax, then keep the smallest prefix of the sorted distribution
whose mass reaches top_p (token i is kept while the mass before it is < top_p) and renormalise.
Ties are broken by lower token id.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def probs(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array
) -> jax.Array:
    """[R, V] logits + per-row temperature/top_p/top_k [R] -> float32 probabilities [R, V].

    Rows with temperature <= 0 get a one-hot at the argmax (the greedy limit). top_k <= 0 or
    >= V disables top-k; top_p >= 1 disables top-p.

    The per-row parameters are small host arrays: when no row uses top-k or top-p, the
    selection of each row's best tokens (`_filtered_probs`: ~1 ms per row at V=49k on a CPU, and
    the whole sort, ~22 ms per row, where a row keeps more than its candidates) is skipped.
    """
    vocab = np.shape(logits)[-1]
    top_k, top_p = np.asarray(top_k), np.asarray(top_p)
    if np.any((top_k > 0) & (top_k < vocab)) or np.any(top_p < 1.0):
        return _filtered_probs(logits, temperature, top_p, top_k)
    return _plain_probs(logits, temperature)


@jax.jit
def _plain_probs(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """`probs` without top-k/top-p: softmax(logits / T), one-hot argmax rows where T <= 0."""
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)[:, None]
    soft = jax.nn.softmax(logits / jnp.where(temperature > 0, temperature, 1.0), axis=-1)
    greedy = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(temperature > 0, soft, greedy)


# Candidates a top-k / top-p row is read from before the whole vocabulary is sorted. On this
# CPU (R=64, V=49,152) jax.lax.top_k(1024) takes ~28 ms against ~1.4 s for the stable argsort of
# every row (docs/performance.md section 21); a nucleus of more than this many tokens falls back.
NUM_CANDIDATES = 1024


@jax.jit
def _filtered_probs(
    logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array
) -> jax.Array:
    """`probs` with top-k/top-p. Each row's kept tokens are read from its `NUM_CANDIDATES` best
    (lax.top_k: descending, ties to the lower id, the sort's own order); only when some row
    keeps more than that (a top-k past it, or a nucleus the candidates do not reach) is the whole
    vocabulary sorted (`_sorted_probs`)."""
    scores, temperature, top_p, k, greedy = filter_inputs(logits, temperature, top_p, top_k)
    rows, vocab = scores.shape
    num = min(NUM_CANDIDATES, vocab)
    values, ids = jax.lax.top_k(scores, num)
    rank = jnp.arange(num)[None, :]
    # The softmax's normalizer: over the top k when top-k is on, else over the whole vocabulary.
    top = jax.scipy.special.logsumexp(jnp.where(rank < k, values, -jnp.inf), axis=-1, keepdims=True)
    whole = jax.scipy.special.logsumexp(scores, axis=-1, keepdims=True)
    lse = jnp.where(k < vocab, top, whole)
    cand = jnp.where(rank < k, jnp.exp(values - lse), 0.0)
    mass = jnp.cumsum(cand, axis=-1)
    nucleus = jnp.where(mass - cand < top_p, cand, 0.0)
    nucleus = nucleus / jnp.sum(nucleus, axis=-1, keepdims=True)
    cand = jnp.where(top_p < 1.0, nucleus, cand)
    filtered = jnp.zeros_like(scores).at[jnp.arange(rows)[:, None], ids].set(cand)
    # A row is read whole from its candidates when what it keeps ends inside them: top-k within
    # them, or a nucleus whose mass is reached by them (the next token, mass before it >= top_p,
    # would not be kept). A row without top-k/top-p keeps the plain softmax; a greedy row, its
    # argmax.
    plain = (k >= vocab) & (top_p >= 1.0)
    fits = (temperature <= 0) | plain | (k <= num) | ((top_p < 1.0) & (mass[:, -1:] >= top_p))
    fast = jnp.where(plain, jnp.exp(scores - whole), filtered)
    fast = jnp.where(temperature > 0, fast, greedy)
    return jax.lax.cond(jnp.all(fits), lambda: fast,
                        lambda: _sorted_probs(scores, temperature, top_p, k, greedy))


def filter_inputs(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array):
    """What both top-k/top-p paths read: scores = logits / T [R, V], the parameters as [R, 1]
    columns (top-k as the count kept, V when off) and the greedy rows' one-hot argmax."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)[:, None]
    top_p = jnp.asarray(top_p, jnp.float32)[:, None]
    top_k = jnp.asarray(top_k, jnp.int32)[:, None]
    scores = logits / jnp.where(temperature > 0, temperature, 1.0)
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    greedy = jax.nn.one_hot(argmax(logits), vocab, dtype=jnp.float32)
    return scores, temperature, top_p, k, greedy


def _sorted_probs(scores: jax.Array, temperature: jax.Array, top_p: jax.Array, k: jax.Array,
                  greedy: jax.Array) -> jax.Array:
    """The transform over the whole sorted vocabulary (the reference's own way)."""
    vocab = scores.shape[-1]
    order = jnp.argsort(-scores, axis=-1, stable=True)  # descending, ties -> lower id first
    sorted_scores = jnp.take_along_axis(scores, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    sorted_scores = jnp.where(rank < k, sorted_scores, -jnp.inf)
    sorted_probs = jax.nn.softmax(sorted_scores, axis=-1)

    keep = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p
    nucleus = jnp.where(keep, sorted_probs, 0.0)
    nucleus = nucleus / jnp.sum(nucleus, axis=-1, keepdims=True)
    sorted_probs = jnp.where(top_p < 1.0, nucleus, sorted_probs)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.where(temperature > 0, jnp.take_along_axis(sorted_probs, inverse, axis=-1), greedy)


def sampling_mode(temperature, top_p, top_k, vocab: int) -> str:
    """The host's choice of sampling program for per-row parameters (numpy arrays):
    "greedy" (every row temperature <= 0: an argmax), "plain" (softmax), or "filtered"
    (some row uses top-k or top-p: the vocabulary sort)."""
    temperature, top_p, top_k = np.asarray(temperature), np.asarray(top_p), np.asarray(top_k)
    if not np.any(temperature > 0):
        return "greedy"
    if np.any((top_k > 0) & (top_k < vocab)) or np.any(top_p < 1.0):
        return "filtered"
    return "plain"


def probs_for_mode(logits: jax.Array, temperature, top_p, top_k, mode: str) -> jax.Array:
    """`probs` with the program chosen beforehand (`sampling_mode`); usable inside a jit."""
    if mode == "filtered":
        return _filtered_probs(logits, temperature, top_p, top_k)
    return _plain_probs(logits, temperature)


def sample_for_mode(logits: jax.Array, temperature, top_p, top_k, key, mode: str) -> jax.Array:
    """`sample` with the program chosen beforehand (`sampling_mode`); usable inside a jit and
    the same computation as `sample` (same draws for the same key and logits)."""
    if mode == "greedy":
        return _argmax(logits)
    return _draw(logits, probs_for_mode(logits, temperature, top_p, top_k, mode), temperature, key)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    key: jax.Array,
) -> jax.Array:
    """One token per row [R] (int32); temperature 0 rows take the argmax (lowest id on ties).
    An all-greedy batch is just the argmax: no softmax, no sort."""
    if not np.any(np.asarray(temperature) > 0):
        return _argmax(logits)
    return _draw(logits, probs(logits, temperature, top_p, top_k), temperature, key)


def argmax(logits: jax.Array) -> jax.Array:
    """int32 index of the maximum over the last axis, exactly `jnp.argmax`'s (the first maximum;
    a row with a NaN gives its first NaN), computed as a max reduction and a min over the
    positions holding it. XLA:CPU runs jnp.argmax as one variadic reduction at ~0.4 G elements/s:
    0.9 ms for 8 rows of a 49k vocabulary (every decode step's greedy token), this 0.2 ms."""
    nan = jnp.isnan(logits)
    is_top = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, logits == jnp.max(logits, axis=-1, keepdims=True))
    positions = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(is_top, positions, logits.shape[-1] - 1), axis=-1)


_argmax = jax.jit(argmax)


@jax.jit
def _draw(logits: jax.Array, p: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    drawn = jax.random.categorical(key, jnp.log(p), axis=-1)
    return jnp.where(jnp.asarray(temperature) > 0, drawn, argmax(logits)).astype(jnp.int32)


@jax.jit
def greedy_accept(
    draft: jax.Array, target_logits: jax.Array, num_drafts: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """draft [n, B-1] tokens at block positions 1..B-1; target_logits [n, B, V] where row j
    predicts position j+1. Returns (accepted [n]: length of the matching draft prefix,
    bonus [n]: the target's argmax right after it).

    `num_drafts` [n] (optional): row i verifies only its first num_drafts[i] drafts (ragged
    blocks padded to one width); the rest never match, so accepted[i] <= num_drafts[i]."""
    return greedy_accept_tokens(draft, argmax(target_logits), num_drafts)


def greedy_accept_tokens(
    draft: jax.Array, target: jax.Array, num_drafts: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """`greedy_accept` given the target's argmax tokens [n, B] instead of its logits."""
    match = (draft.astype(jnp.int32) == target[:, :-1]) & _valid(draft.shape, num_drafts)
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)
    bonus = jnp.take_along_axis(target, accepted[:, None], axis=-1)[:, 0]
    return accepted.astype(jnp.int32), bonus


def _valid(shape: tuple[int, int], num_drafts: jax.Array | None) -> jax.Array:
    """[n, B-1] bool: draft j of row i is verified (j < num_drafts[i]; all when None)."""
    if num_drafts is None:
        return jnp.ones(shape, bool)
    return jnp.arange(shape[1])[None, :] < jnp.asarray(num_drafts, jnp.int32)[:, None]


@jax.jit
def rejection_accept(
    draft: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    key: jax.Array,
    num_drafts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling (Leviathan et al.; dflash `_rejection_sample`), per row:
    accept draft j while u_j * q_j(d_j) < p_j(d_j) with u_j ~ U[0, 1); at the first rejection
    a, sample the bonus from norm(max(p_a - q_a, 0)) (falling back to p_a when that is all
    zero); if all B-1 drafts pass, sample the bonus from p at the last position.

    draft [n, B-1], draft_probs q [n, B-1, V], target_probs p [n, B, V] -> (accepted, bonus).
    `num_drafts` [n] (optional): row i verifies only its first num_drafts[i] drafts; when they
    all pass, the bonus comes from p at position num_drafts[i] (q counts as 0 there), exactly
    as for a block of num_drafts[i] + 1 tokens. Lossless as long as num_drafts does not depend
    on the sampled drafts themselves (the adaptive policy reads only q, never the draws).
    """
    n, gamma = draft.shape
    draft = draft.astype(jnp.int32)
    key_accept, key_bonus = jax.random.split(key)
    p_draft = jnp.take_along_axis(target_probs[:, :gamma], draft[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_accept, (n, gamma), jnp.float32)
    valid = _valid((n, gamma), num_drafts)
    passed = ((u * q_draft < p_draft) & valid).astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(passed, axis=-1), axis=-1)

    # All verified drafts accepted (accepted == num_drafts): q counts as 0 there, so the
    # residual max(p - 0, 0) is p itself (the appended zero row covers accepted == B-1).
    q_padded = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    p_at = jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0]
    q_at = jnp.take_along_axis(q_padded, accepted[:, None, None], axis=1)[:, 0]
    if num_drafts is not None:
        q_at = jnp.where((accepted < jnp.asarray(num_drafts, jnp.int32))[:, None], q_at, 0.0)
    residual = jnp.maximum(p_at - q_at, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(total > 0, residual / jnp.maximum(total, jnp.finfo(jnp.float32).tiny), p_at)
    bonus = jax.random.categorical(key_bonus, jnp.log(residual), axis=-1)
    return accepted.astype(jnp.int32), bonus.astype(jnp.int32)


def per_row_params(rows: int, repeat: int, temperature, top_p, top_k) -> tuple[np.ndarray, ...]:
    """Per-sequence sampling parameters repeated `repeat` times per sequence and padded (greedy,
    no filter) to rows * repeat rows."""
    out = (np.zeros(rows * repeat, np.float32), np.ones(rows * repeat, np.float32), np.zeros(rows * repeat, np.int32))
    for array, values in zip(out, (temperature, top_p, top_k)):
        values = np.repeat(np.asarray(values, array.dtype), repeat)
        array[: len(values)] = values
    out[2][:] = np.maximum(out[2], 0)
    return out
