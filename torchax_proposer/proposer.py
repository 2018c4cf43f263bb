"""`DFlashProposer`: the drafter's per-sequence state machine on JAX (used by the runtime).

State of a sequence with committed length L (tokens whose target K/V is final):
  - its cache slot holds context K/V of positions 0 .. cache_len-1,
  - its row of the pending pool holds the target features of positions cache_len .. L-1 (at most
    one bucket's worth), projected and appended by the next `propose` inside the same jitted call
    (beyond `draft_pending_rows` of them, by a flush just before it).
So cache_len + num_pending == L at all times: the drafter never holds anything of an unverified draft.
The pending rows of all sequences live in one device array [max_num_seqs, bucket, n_aux*H] indexed
by cache slot, so that a commit is one donated scatter and a draft one gather, whatever the batch.

Protocol per decode step:  propose(ids, bonus) -> drafts;  target verifies;  commit(ids, a, aux).
A DFlash 2 drafter (torchax_proposer/dflash2.py) drafts its selector's path: `propose` gives the
greedy path, `propose_path(ids, bonus, temperatures=, key=)` samples one and returns q over its
candidates for rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .config import DrafterStateError
from .cpu_lowering import FEW_ROWS
from .jax_drafter import (JAX_DTYPES, NARROW_ROWS, DraftPath, as_numpy, bfloat16_linear_weights, draft_weights, init_draft_cache,
                          model_params, next_power_of_two, reads_cache_in_place, replicated_over)
from .jitted import jitted_drafter
from .loader import load_draft_model, torch_dtype


@dataclass
class _SeqState:
    slot: int
    cache_len: int
    num_pending: int = 0  # rows of its slot's pending pool row that are real

    @property
    def committed_len(self) -> int:
        return self.cache_len + self.num_pending


class DFlashProposer:
    """Drafts blocks for many sequences at once with a static, donated draft KV cache.

    `target_embed` / `target_lm_head`: the target's [V, H] arrays (not in drafter checkpoints).
    `block_size`: defaults to the checkpoint's; a smaller one serves e.g. a b16 drafter at B=8.
    `greedy_head`: (greedy, head), the target's greedy head kernel and arrays over the drafter's lm_head rows
    (`draft_greedy`): a propose reading no logits takes its tokens from it (kernel rows, float32, plain logits).
    """

    # Prompts are appended in chunks of power-of-two rows from min_prefill_rows to prefill_chunk.
    min_prefill_rows = 32
    prefill_chunk = 256
    # Smallest cache window read by a draft; windows grow by powers of two up to max_context_len.
    min_read_len = 128

    def __init__(self, draft_dir: str | Path, *, target_embed: Any, target_lm_head: Any, target_config: dict[str, Any],
                 max_num_seqs: int, max_context_len: int, block_size: int | None = None, dtype: str = "float32",
                 token_map: Sequence[int] | None = None, few_row_matmul: Callable | None = None,
                 kernel_lm_head: Any = None, cpu_attention: Callable | None = None, greedy_head: Any = None,
                 narrow_layout: Callable | None = None, cache_attention: Callable | None = None):
        self.model = load_draft_model(draft_dir, target_config, dtype)
        self._matmul = few_row_matmul  # a CPU kernel for few-row projections (`cpu_lowering.few_row_matmul`)
        self._attention = cpu_attention, cache_attention  # CPU kernels (`cpu_lowering.cpu_attention`, `.cache_attention`)
        self.config = self.model.config
        self.block_size = int(self.config.block_size if block_size is None else block_size)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one bonus + at least one draft), got {self.block_size}")
        if max_num_seqs < 1 or max_context_len < 1:
            raise ValueError(f"max_num_seqs and max_context_len must be positive, got {max_num_seqs}, {max_context_len}")
        self.target_layer_ids = list(self.config.target_layer_ids)
        self.mask_token_id = self.config.mask_token_id
        self.max_num_seqs = max_num_seqs
        self.max_context_len = max_context_len
        self.num_features = self.config.num_context_features

        self.dtype = JAX_DTYPES[torch_dtype(dtype)]
        self._in_place = reads_cache_in_place(self.config, self.dtype, cache_attention)  # no window: one draft program per shape
        shape = (self.config.vocab_size, self.config.hidden_size)
        for name, array in (("target_embed", target_embed), ("target_lm_head", target_lm_head)):
            if tuple(array.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(array.shape)}, expected [vocab, hidden] = {shape}")
        self.embed = jnp.asarray(target_embed, self.dtype)
        self.lm_head = jnp.asarray(target_lm_head, self.dtype)
        # A hot-token map (FR-Spec): drafts come from these ids only, so the per-draft lm_head read
        # shrinks from V rows to len(token_map) (on a CPU that read is most of a small drafter's time).
        self.token_map = None
        if token_map is not None:
            self.token_map = jnp.asarray(self.config.check_token_map(token_map), jnp.int32)
            self.lm_head = self.lm_head[self.token_map]
        self.params = model_params(self.model, stacked=True)  # one product per stack of projections
        self.k_cache, self.v_cache = init_draft_cache(self.model, max_num_seqs, max_context_len, self.dtype)

        # Pending rows after a commit are at most one block; one bucket keeps steady state at one shape.
        self.pending_bucket = next_power_of_two(self.block_size)
        self.pending = jnp.zeros((max_num_seqs, self.pending_bucket, self.num_features), self.dtype)
        # The pool rows a draft reads (static): a sequence with more pending is flushed first (one
        # more launch). The adaptive worker reads 2, what a plain step or a 1-draft verify commits.
        self.draft_pending_rows = self.pending_bucket
        # A tensor-parallel target's embed / lm_head live on a device mesh (used as they are); the
        # small drafter's arrays are replicated over it: one fixed placement, no per-call transfers.
        replicated = replicated_over(target_embed)
        if replicated is not None:
            self.params, self.k_cache, self.v_cache, self.pending, self.token_map = jax.device_put(
                (self.params, self.k_cache, self.v_cache, self.pending, self.token_map), replicated)
            if self.token_map is not None:  # the mapped lm_head is a new, small array
                self.lm_head = jax.device_put(self.lm_head, replicated)
        # The kernel reads bf16 weights (fewer bytes, `draft_weights`) as they are, or in its `narrow_layout`.
        narrow = few_row_matmul is not None and self.dtype == jnp.float32
        self.narrow_params = bfloat16_linear_weights(self.model, self.params, narrow_layout) if narrow else self.params
        self.narrow_rows = NARROW_ROWS if narrow_layout is None else FEW_ROWS  # laid out for AMX tiles: all rows
        mapped = (lambda a: a) if self.token_map is None else (lambda a: jnp.asarray(a)[self.token_map])  # noqa: E731
        self.narrow_head = jax.tree.map(mapped, kernel_lm_head) if narrow and kernel_lm_head is not None else self.lm_head
        plain = self.config.output_multiplier == 1 and not self.config.final_logit_softcapping
        self._greedy = greedy_head if narrow and plain else None
        if self._greedy is not None and jax.tree.leaves(greedy_head[1])[0].shape != self.lm_head.shape:
            raise ValueError(f"greedy_head's arrays must hold the drafter's lm_head rows {self.lm_head.shape}")
        self._jit = self._jitted(self.block_size)
        self._blocks_used = {self.block_size}  # draft blocks asked for (their programs count too)
        self._seqs: dict[Any, _SeqState] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    # ---- sequence lifecycle -------------------------------------------------------------------

    def add(self, seq_id: Any, context_features: Any) -> None:
        """Registers a sequence after prefill; context_features [L, n_aux*H]: prompt aux features."""
        if seq_id in self._seqs:
            raise DrafterStateError(f"sequence {seq_id!r} is already added")
        if not self._free_slots:
            raise DrafterStateError(f"all {self.max_num_seqs} drafter slots are in use (max_num_seqs)")
        # Via the host: prompt lengths vary, and device-side padding would compile once per length.
        features = as_numpy(context_features)
        self._check_rows(seq_id, features, min_rows=1)
        if len(features) > self.max_context_len:
            raise DrafterStateError(f"sequence {seq_id!r}: prompt of {len(features)} rows exceeds "
                                    f"max_context_len={self.max_context_len}")
        state = _SeqState(slot=self._free_slots.pop(), cache_len=0)
        self._seqs[seq_id] = state
        for start in range(0, len(features), self.prefill_chunk):
            chunk = features[start : start + self.prefill_chunk]
            bucket = max(self.pending_bucket, self.min_prefill_rows, next_power_of_two(len(chunk)))
            padded = np.zeros((1, bucket, self.num_features), np.float32)
            padded[0, : len(chunk)] = chunk
            self._extend(state, jax.device_put(padded), len(chunk))

    def release(self, seq_id: Any) -> None:
        """Forgets a sequence and frees its cache slot (its stale rows are never read again)."""
        self._free_slots.append(self._state(seq_id).slot)
        del self._seqs[seq_id]

    def committed_len(self, seq_id: Any) -> int:
        return self._state(seq_id).committed_len

    def context_kv(self, seq_id: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per draft layer, the cached context (K, V) [cache_len, kv_heads, head_dim] of a sequence
        (rows still pending since the last commit are not in it yet)."""
        state = self._state(seq_id)
        rows = lambda cache: np.asarray(cache[state.slot, :, : state.cache_len]).swapaxes(0, 1)  # noqa: E731 (head-major)
        return [(rows(k), rows(v)) for k, v in zip(self.k_cache, self.v_cache)]

    def num_compilations(self) -> int:
        """Programs compiled so far by the jitted drafter functions (shared by same-config proposers)."""
        return sum(self._jitted(b).num_traces for b in self._blocks_used)

    def _jitted(self, block: int):
        greedy = None if self._greedy is None else self._greedy[0]
        dense, cached = self._attention
        return jitted_drafter(self.config, block, self._matmul, dense, greedy, cached)

    def _draft_jit(self, block_size: int | None):
        """The jitted drafter of a `block_size` draft block (default: the proposer's; shorter: fewer drafts)."""
        block = self.block_size if block_size is None else int(block_size)
        if not 2 <= block <= self.block_size:
            raise ValueError(f"draft block_size must be in [2, {self.block_size}], got {block_size!r}")
        self._blocks_used.add(block)
        return self._jitted(block), block

    # ---- decode step ----------------------------------------------------------------------------

    def propose(
        self, seq_ids: Sequence[Any], bonus_tokens: Any, *, return_logits: bool = False,
        return_confidence: bool = False, block_size: int | None = None,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Drafts B-1 tokens per sequence: block [bonus, MASK x (B-1)] at positions L .. L+B-1
        (B = `block_size`, default the proposer's; a shorter block drafts fewer tokens).
        Returns np.int32 [n, B-1] (and float32 logits [n, B-1, V] when return_logits, or the
        drafter's confidence [n, B-1] when return_confidence: each greedy draft's probability
        under the drafter's softmax, over the token map if any, computed on the device).
        A DFlash 2 drafter returns its selector's greedy path; it has no logits to sample drafts
        from (its draws depend on the path so far): sampling goes through `propose_path`."""
        if return_logits and return_confidence:
            raise ValueError("propose: return_logits and return_confidence are exclusive (q gives both)")
        if self.config.is_dflash2:
            if return_logits or return_confidence:
                raise ValueError("a DFlash 2 drafter samples its own path: use propose_path(..., temperatures=, key=)")
            return self.propose_path(seq_ids, bonus_tokens, block_size=block_size).tokens
        jit, block = self._draft_jit(block_size)
        batch = self._draft_batch(seq_ids, bonus_tokens)
        if batch is None:
            empty, vocab = np.zeros((0, block - 1), np.int32), (self.config.vocab_size,) if return_logits else ()
            return (empty, np.zeros(empty.shape + vocab, np.float32)) if return_logits or return_confidence else empty
        states, inputs, statics = batch
        n = len(inputs[-1])
        params = draft_weights(self.params, self.narrow_params, n * max(block, statics["pending_rows"]), self.narrow_rows)
        rows = n * (block - 1)
        if self._greedy is not None and not (return_logits or return_confidence) and rows <= FEW_ROWS:
            tokens, self.k_cache, self.v_cache = jit.draft_greedy(
                params, self.embed, self._greedy[1], self.k_cache, self.v_cache, *inputs, self.token_map, **statics)
            self._drafted(states)
            return np.asarray(tokens)[: len(states)]
        head = draft_weights(self.lm_head, self.narrow_head, rows)
        tokens, logits, confidence, self.k_cache, self.v_cache = jit.draft(
            params, self.embed, head, self.k_cache, self.v_cache, *inputs, self.token_map, **statics)
        self._drafted(states)
        if return_confidence:
            return np.asarray(tokens)[: len(states)], np.asarray(confidence)[: len(states)]
        tokens = np.asarray(tokens)[: len(states)]
        if not return_logits:
            return tokens
        logits = np.asarray(logits)[: len(states)]
        if self.token_map is not None:  # ids outside the map: -inf (a proposal over the map)
            full = np.full(logits.shape[:-1] + (self.config.vocab_size,), -np.inf, np.float32)
            full[..., np.asarray(self.token_map)] = logits
            logits = full
        return tokens, logits

    def propose_path(
        self, seq_ids: Sequence[Any], bonus_tokens: Any, *, temperatures: Any = None, key: jax.Array | None = None,
        block_size: int | None = None,
    ) -> DraftPath:
        """DFlash 2: the selector's path from each bonus token, in one jitted step.

        temperatures None: greedy (the argmax path; `probs` is None). temperatures [n] (0 = a
        greedy row) with a PRNG `key`: each draft is drawn from q = softmax(score / T) over the K
        candidates of its position given the draft before it, and q is returned for rejection
        sampling (`dense_draft_probs` turns it into `rejection_accept`'s draft_probs)."""
        if not self.config.is_dflash2:
            raise ValueError("propose_path needs a DFlash 2 drafter; DFlash 1 samples from propose(..., return_logits=True)")
        sampling = temperatures is not None
        if sampling:
            temperatures = np.asarray(temperatures, np.float32).reshape(-1)
            if len(temperatures) != len(seq_ids) or not np.all(temperatures >= 0) or key is None:
                raise ValueError(f"sampling needs {len(seq_ids)} temperatures >= 0 and a PRNG key")
        jit, block = self._draft_jit(block_size)
        batch = self._draft_batch(seq_ids, bonus_tokens)
        top_k = self.config.selector_top_k
        if batch is None:
            shape = (0, block - 1)
            return DraftPath(np.zeros(shape, np.int32), np.zeros((*shape, top_k), np.int32),
                             np.zeros((*shape, top_k), np.float32) if sampling else None)
        states, inputs, statics = batch
        if sampling:  # padding rows are greedy
            padded = np.zeros(inputs[-1].shape[0], np.float32)
            padded[: len(states)] = temperatures
            temperatures = padded
        tokens, candidates, probs, self.k_cache, self.v_cache = jit.draft_path(
            self.params, self.embed, self.lm_head, self.k_cache, self.v_cache, *inputs, self.token_map, temperatures,
            key, **statics)
        self._drafted(states)
        n = len(states)
        return DraftPath(np.asarray(tokens)[:n], np.asarray(candidates)[:n], None if probs is None else np.asarray(probs)[:n])

    def commit(self, seq_ids: Sequence[Any], accepted_counts: Any, aux_features: Sequence[Any]) -> None:
        """After verification: aux_features[i] [a_i+1, n_aux*H] are the target's features of the
        block's first a_i+1 tokens (bonus + accepted drafts); committed length becomes L + a_i + 1."""
        counts = [int(a) for a in np.asarray(accepted_counts).reshape(-1)]
        if not len(seq_ids) == len(counts) == len(aux_features):
            raise DrafterStateError(f"commit got {len(seq_ids)} ids, {len(counts)} accepted counts, "
                                    f"{len(aux_features)} feature arrays")
        states = [self._state(s) for s in seq_ids]
        for seq_id, state, count, rows in zip(seq_ids, states, counts, aux_features):
            if not 0 <= count <= self.block_size - 1:
                raise DrafterStateError(f"sequence {seq_id!r}: accepted count {count} outside [0, {self.block_size - 1}]")
            self._check_rows(seq_id, rows, min_rows=count + 1, max_rows=count + 1)
            if state.committed_len + count + 1 > self.max_context_len:
                raise DrafterStateError(f"sequence {seq_id!r}: committed length {state.committed_len + count + 1} "
                                        f"exceeds max_context_len={self.max_context_len}")
        self._flush([s for s in states if s.num_pending])  # two commits without a propose between
        padded = np.zeros((len(states), self.pending_bucket, self.num_features), np.float32)
        for i, rows in enumerate(aux_features):
            padded[i, : len(rows)] = as_numpy(rows)
        self._write_pending(states, counts, jax.device_put(padded))

    def commit_block(self, seq_ids: Sequence[Any], accepted_counts: Any, features: jax.Array) -> None:
        """`commit` for a whole verify batch at once: features [S >= n, B, n_aux*H] holds the
        target's features of every block row (`TargetRunner.verify`); sequence i commits rows
        0 .. accepted_counts[i]. The rows stay on the device: one scatter into the pending pool.
        A None id is a batch row without drafter state: its rows are dropped."""
        counts = np.asarray(accepted_counts).reshape(-1).astype(np.int64)
        if len(counts) != len(seq_ids) or features.ndim != 3 or features.shape[0] < len(seq_ids):
            raise DrafterStateError(f"commit_block got {len(seq_ids)} ids, {len(counts)} accepted counts, "
                                    f"features {tuple(features.shape)}")
        kept = [i for i, s in enumerate(seq_ids) if s is not None]
        seq_ids, counts = [seq_ids[i] for i in kept], counts[kept]
        states = [self._state(s) for s in seq_ids]
        if features.shape[1] > self.pending_bucket or features.shape[2] != self.num_features:
            raise DrafterStateError(f"features {tuple(features.shape)}: expected [n, <= {self.pending_bucket}, "
                                    f"{self.num_features}]")
        lengths = np.array([s.committed_len for s in states], np.int64) + counts + 1
        for i in np.flatnonzero((counts < 0) | (counts > min(self.block_size, features.shape[1]) - 1)):
            raise DrafterStateError(f"sequence {seq_ids[i]!r}: accepted count {counts[i]} outside the block")
        for i in np.flatnonzero(lengths > self.max_context_len):
            raise DrafterStateError(f"sequence {seq_ids[i]!r}: committed length {lengths[i]} exceeds "
                                    f"max_context_len={self.max_context_len}")
        counts = counts.tolist()
        # A sequence not drafted since its last commit (an adaptive plain step) still has pending
        # rows: append to them while they fit the bucket, else flush them first (one batched call).
        self._flush([s for s, c in zip(states, counts) if s.num_pending and s.num_pending + c + 1 > self.pending_bucket])
        by_row = dict(zip(kept, states))
        self._write_pending([by_row.get(i) for i in range(features.shape[0])], counts, features)

    # ---- internals ----------------------------------------------------------------------------

    def _write_pending(self, rows: list[_SeqState | None], counts: list[int], features: jax.Array) -> None:
        """Appends rows 0 .. counts[i] of features[j] [S, Q, n_aux*H] to the pending rows of the
        i-th sequence of `rows` (row j's; None and rows past the list are dropped): one donated
        scatter into the pool."""
        rows = rows + [None] * (features.shape[0] - len(rows))
        slots = np.array([0 if s is None else s.slot for s in rows], np.int32)
        offsets = np.array([self.pending_bucket if s is None else s.num_pending for s in rows], np.int32)
        self.pending = self._jit.write_pending(self.pending, features, slots, offsets)
        for state, count in zip((s for s in rows if s is not None), counts):
            state.num_pending += count + 1

    def _draft_batch(self, seq_ids: Sequence[Any], bonus_tokens: Any) -> tuple[list[_SeqState], tuple, dict] | None:
        """Checks a propose call and pads it to a power-of-two batch: (states, the draft step's
        inputs from `pending` to `bonus_tokens`, its static read_len and pending_rows), or None."""
        states = [self._state(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise DrafterStateError(f"duplicate sequence ids in propose: {list(seq_ids)}")
        bonus = np.asarray(bonus_tokens).reshape(-1)
        if len(bonus) != len(states):
            raise DrafterStateError(f"{len(bonus)} bonus tokens for {len(states)} sequences")
        if len(states) == 0:
            return None
        if not np.issubdtype(bonus.dtype, np.integer) or bonus.min() < 0 or bonus.max() >= self.config.vocab_size:
            raise DrafterStateError(f"bonus tokens must be token ids in [0, {self.config.vocab_size}), got {bonus}")

        # Rows past what the draft reads go to the caches first; the draft then sees them cached.
        self._flush([s for s in states if s.num_pending > self.draft_pending_rows])
        batch = next_power_of_two(len(states))
        pad = batch - len(states)
        # Padding rows: slot 0, nothing cached, nothing pending -> they only write the trash row.
        slots = np.array([s.slot for s in states] + [0] * pad, np.int32)
        cache_lens = np.array([s.cache_len for s in states] + [0] * pad, np.int32)
        new_lens = np.array([s.num_pending for s in states] + [0] * pad, np.int32)
        statics = dict(read_len=0 if self._in_place else self.read_len(seq_ids), pending_rows=self.draft_pending_rows)
        inputs = (self.pending, new_lens, cache_lens, slots,  # host arrays: the dispatch copies them, cheaper than device_put
                  np.concatenate([bonus.astype(np.int32), np.zeros(pad, np.int32)]))
        return states, inputs, statics

    def read_len(self, seq_ids: Sequence[Any]) -> int:
        """`window` of these sequences' longest committed context (cached + pending rows)."""
        return self.window(max((self._state(s).committed_len for s in seq_ids), default=0))

    def window(self, committed_len: int) -> int:
        """The cache window a draft reads at `committed_len` rows (a static shape: a program per window)."""
        return min(self.max_context_len, max(self.min_read_len, next_power_of_two(committed_len)))

    @staticmethod
    def _drafted(states: list[_SeqState]) -> None:
        """After a draft step: each sequence's pending rows are in its cache now."""
        for state in states:
            state.cache_len, state.num_pending = state.committed_len, 0

    def _state(self, seq_id: Any) -> _SeqState:
        if seq_id not in self._seqs:
            raise DrafterStateError(f"unknown sequence {seq_id!r} (not added, or released)")
        return self._seqs[seq_id]

    def _check_rows(self, seq_id: Any, rows: Any, *, min_rows: int, max_rows: int | None = None) -> None:
        shape = tuple(rows.shape)
        if len(shape) != 2 or shape[1] != self.num_features:
            raise DrafterStateError(f"sequence {seq_id!r}: context features have shape {shape}, expected [rows, "
                                    f"{self.num_features}] (= {len(self.target_layer_ids)} target layers x hidden "
                                    f"{self.config.hidden_size})")
        if shape[0] < min_rows or (max_rows is not None and shape[0] > max_rows):
            expected = f"{min_rows}" if max_rows == min_rows else f">= {min_rows}"
            raise DrafterStateError(f"sequence {seq_id!r}: got {shape[0]} feature rows, expected {expected}")

    def _flush(self, states: list[_SeqState]) -> None:
        """Moves the pending rows of `states` into their caches in one call (padding rows write the trash row)."""
        if not states:
            return
        pad = next_power_of_two(len(states)) - len(states)
        lens = [np.array([getattr(s, k) for s in states] + [0] * pad, np.int32) for k in ("num_pending", "cache_len", "slot")]
        self.k_cache, self.v_cache = self._jit.flush(self.params, self.k_cache, self.v_cache, self.pending, *lens)
        self._drafted(states)  # (the same bookkeeping: pending rows are cached now)

    def _extend(self, state: _SeqState, padded_rows: jax.Array, num_rows: int) -> None:
        """Appends padded_rows [1, bucket, n_aux*H] (first num_rows real) to the sequence's cache."""
        lens = [np.array([value], np.int32) for value in (num_rows, state.cache_len, state.slot)]
        self.k_cache, self.v_cache = self._jit.extend(self.params, self.k_cache, self.v_cache, padded_rows, *lens)
        state.cache_len += num_rows

