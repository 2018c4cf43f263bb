"""Host-side packing of ragged sequences into one bucketed device batch.

Every shape is padded to a power of two (tokens, sequences, logit rows, the longest query block,
the page table's width = the longest context in pages), so a steady decode loop reuses one
compiled forward per context bucket. Prefills may pad their token rows more finely
(`fine_bucket`): their cost follows the rows, and their programs compile fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np

from jax_backend.paged_attention import choose_query_tile


class BatchError(ValueError):
    """A SeqInput that cannot be run as given (the message names the sequence and the field)."""


@dataclasses.dataclass(frozen=True)
class SeqInput:
    """Run `token_ids` at positions `start_pos ..` for one sequence whose cache already holds
    `start_pos` tokens in the pages of `page_table` (which must cover start_pos + len(token_ids)).
    `logits`: "last" -> one row (the last token), "all" -> one row per token."""

    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[int]
    logits: Literal["last", "all"] = "last"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """The arrays of one forward (host numpy from `build_batch`: the jitted step copies them to
    the device; device arrays work alike). T, S, R are power-of-two buckets."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]: page * page_size + offset; padding -> scratch page 0
    kv_lens: jax.Array  # i32[S]: cached tokens after this step
    page_indices: jax.Array  # i32[S, W]: W = context bucket in pages; unused entries -> page 0
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    logits_indices: jax.Array  # i32[R]: token rows whose logits are wanted
    max_q_len: int = dataclasses.field(metadata=dict(static=True))  # bucketed longest q_len
    # how this step's new tokens attend to each other (`paged_attention.choose_query_tile`)
    query_tile: int = dataclasses.field(default=0, metadata=dict(static=True))
    # attention visits only the page chunks the longest cached prefix needs (a trip count on the
    # device; for CPU, see `paged_attention`), not all W columns
    loop_to_longest: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # the logits' matmul computes [V, R] and then transposes (`model.final_logits`; for CPU)
    vocab_major_logits: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # the cached prefix's attention runs the CPU kernel where it applies (`paged_attention._attend_pages`)
    cpu_attention: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # projections and logits of steps of <= 64 rows run the CPU matmul kernel (`model.project`)
    cpu_matmul: bool = dataclasses.field(default=False, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Where each sequence landed: token rows [token_start, token_start + q_len) and logit rows
    [logit_start, logit_start + num_logits)."""

    token_starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    logit_starts: tuple[int, ...]
    num_logits: tuple[int, ...]


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def fine_bucket(n: int, minimum: int = 1) -> int:
    """`bucket(n, minimum)` up to 64; above, n rounded up to an eighth of that power of two
    (5/8, 6/8, 7/8 or all of it): at most 25% padding instead of up to 50%, for 4x the shapes."""
    power = bucket(n, minimum)
    if power <= 64 or power > bucket(n):
        return power
    step = power // 8
    return -(-n // step) * step


def build_batch(
    seqs: Sequence[SeqInput],
    *,
    page_size: int,
    pages_per_seq: int,
    min_tokens: int = 1,
    min_seqs: int = 1,
    min_pages: int = 1,
    fine_tokens: bool = False,
    query_tiles: bool = True,
    loop_to_longest: bool = False,
    vocab_major_logits: bool = False,
    cpu_attention: bool = False,
    cpu_matmul: bool = False,
) -> tuple[Batch, BatchLayout]:
    """Pack `seqs` into a `Batch` (device arrays) plus its host-side `BatchLayout`.

    `fine_tokens`: pad the token rows to `fine_bucket` rather than a power of two. For prefills:
    their matmuls are compute-bound, so every padded row costs as much as a real one (8 prompts
    of 100 tokens ran as 1,024 rows), and a prefill program compiles in about a second.
    `query_tiles`: let attention take query tiles where they compute less (`choose_query_tile`);
    False keeps the dense per-sequence blocks (the layout before tiles, for comparison).
    `loop_to_longest`, `vocab_major_logits`, `cpu_attention`, `cpu_matmul`: see `Batch`.

    The page table covers the cached prefixes (the model attends to this step's tokens as arrays,
    see `prefix_block_attention`): its width is the context bucket, the longest `start_pos` in
    pages rounded up to a power of two (at least `min_pages`, at most `pages_per_seq`; 0 when no
    sequence has a cached prefix). Attention visits every column, a static amount of work per
    bucket, unless `loop_to_longest` lets it stop after the longest prefix's chunks."""
    if not seqs:
        raise BatchError("build_batch needs at least one sequence")
    for i, seq in enumerate(seqs):
        _check(i, seq, page_size, pages_per_seq)

    q_lens = [len(s.token_ids) for s in seqs]
    n_logits = [1 if s.logits == "last" else len(s.token_ids) for s in seqs]
    num_tokens = (fine_bucket if fine_tokens else bucket)(sum(q_lens), min_tokens)
    max_seqs = bucket(len(seqs), min_seqs)
    num_rows = bucket(sum(n_logits))
    max_q_len = min(bucket(max(q_lens)), num_tokens)
    width = context_pages(max(s.start_pos for s in seqs), page_size=page_size, pages_per_seq=pages_per_seq,
                          min_pages=min_pages)

    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.zeros(num_tokens, np.int32)  # padding writes to scratch page 0
    kv_lens = np.zeros(max_seqs, np.int32)
    page_indices = np.zeros((max_seqs, width), np.int32)
    cu_q_lens = np.zeros(max_seqs + 1, np.int32)
    logits_indices = np.zeros(num_rows, np.int32)

    token_starts, logit_starts = [], []
    t = r = 0
    for i, seq in enumerate(seqs):
        q, table = q_lens[i], np.asarray(seq.page_table, np.int32)
        pos = np.arange(seq.start_pos, seq.start_pos + q, dtype=np.int32)
        tokens[t : t + q] = seq.token_ids
        positions[t : t + q] = pos
        slots[t : t + q] = table[pos // page_size] * page_size + pos % page_size
        kv_lens[i] = seq.start_pos + q
        page_indices[i, : min(len(table), width)] = table[:width]
        cu_q_lens[i + 1] = t + q
        logits_indices[r : r + n_logits[i]] = np.arange(t + q - n_logits[i], t + q)
        token_starts.append(t)
        logit_starts.append(r)
        t, r = t + q, r + n_logits[i]
    cu_q_lens[len(seqs) + 1 :] = t  # padding sequences are empty

    # Host arrays go to the jitted step as they are: its C++ dispatch copies them to the device
    # (~20 us for these eight) where `jax.device_put` takes a Python path (~150 us idle, 0.3-0.4 ms
    # in a serving step): host time on every step's critical path.
    batch = Batch(
        tokens, positions, slots, kv_lens, page_indices, cu_q_lens, np.array([len(seqs)], np.int32), logits_indices,
        max_q_len=max_q_len,
        query_tile=choose_query_tile(num_tokens, max_seqs, max_q_len) if query_tiles else 0,
        loop_to_longest=loop_to_longest,
        vocab_major_logits=vocab_major_logits,
        cpu_attention=cpu_attention,
        cpu_matmul=cpu_matmul,
    )
    layout = BatchLayout(tuple(token_starts), tuple(q_lens), tuple(logit_starts), tuple(n_logits))
    return batch, layout


def context_pages(longest_prefix: int, *, page_size: int, pages_per_seq: int, min_pages: int = 1) -> int:
    """The page table's width W of a batch whose longest cached prefix is `longest_prefix` tokens:
    its pages rounded up to a power of two (at least `min_pages`, at most `pages_per_seq`; 0 when
    nothing is cached). A static shape: each width is a compiled program of its own."""
    if not longest_prefix:
        return 0
    return min(pages_per_seq, bucket(-(-longest_prefix // page_size), min_pages))


def _check(i: int, seq: SeqInput, page_size: int, pages_per_seq: int) -> None:
    where = f"sequence {i}"
    if len(seq.token_ids) == 0:
        raise BatchError(f"{where}: token_ids is empty")
    if seq.start_pos < 0:
        raise BatchError(f"{where}: start_pos must be >= 0, got {seq.start_pos}")
    if seq.logits not in ("last", "all"):
        raise BatchError(f"{where}: logits must be 'last' or 'all', got {seq.logits!r}")
    total = seq.start_pos + len(seq.token_ids)
    need = -(-total // page_size)
    if len(seq.page_table) < need:
        raise BatchError(
            f"{where}: page_table has {len(seq.page_table)} pages, {total} tokens need {need} "
            f"(page_size {page_size}); allocate them first"
        )
    if len(seq.page_table) > pages_per_seq:
        raise BatchError(
            f"{where}: page_table has {len(seq.page_table)} pages, more than pages_per_seq "
            f"{pages_per_seq} (max_model_len too small?)"
        )
    if 0 in seq.page_table[:need]:
        raise BatchError(f"{where}: page_table uses page 0, which is reserved as scratch")
