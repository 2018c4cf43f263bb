"""The adaptive worker's startup sweep: compile, before the first request, every program its policy
can choose at a request's first context bucket.

Why: the policy picks ragged verify shapes (S sequences, T rows, Q longest block: 46 of them up to
32 requests) and draft programs (drafter batch x draft block 2, 4, .. B). A fresh engine that
met them while serving stalled a step for each (1-5 s on a CPU): 13 of a 27 s first pass at batch
8 (docs/adaptive.md). SGLang captures its CUDA graphs per batch size at startup for the same
reason. With the persistent compilation cache a later startup mostly loads them.

How: dummy sequences whose target pages are the scratch page 0 (every write lands there, nothing
real is read) and drafter sequences added with zero features, then released. Only greedy
programs at one context bucket are swept (`context` tokens of cached prefix); sampling modes,
longer contexts and prefill shapes still compile when first met.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jax_backend import SeqInput
from jax_backend.batch import bucket
from sgl_dflash.speculative.cost_model import MIN_TOKEN_ROWS, step_shape


_SWEEP_ID = "precompile"


def verify_shapes(max_requests: int, max_block: int) -> list[tuple[int, int, int]]:
    """Every (S, T, Q) that `step_shape` gives for 1 .. max_requests sequences of 1 .. max_block rows."""
    shapes = []
    for s in _powers_up_to(bucket(max_requests)):
        for q in _powers_up_to(bucket(max_block)):
            for t in _powers_up_to(bucket(s * q, MIN_TOKEN_ROWS)):
                lens = _lens_for(s, t, q, max_block)
                if lens is not None and step_shape(lens) == (s, t, q):
                    shapes.append((s, t, q))
    return shapes


def sweep(worker: Any, *, context: int, progress: bool = True) -> int:
    """Runs, on `worker` (an AdaptiveDFlashWorker with no requests), every verify shape with the
    drafter's commit of its features (the pending-row write; per batch bucket also the flush that
    plain steps in a row end in) and every draft program (batch bucket x draft block); the
    policy's cost model learns they are compiled. Returns the number of verify shapes and draft
    programs."""
    runner, proposer, policy = worker.runner, worker.proposer, worker.policy
    block = worker.block_size
    shapes = verify_shapes(proposer.max_num_seqs, block)
    drafts = {(rows, b) for rows in _powers_up_to(bucket(proposer.max_num_seqs)) for b in policy.blocks}
    # One real page table shared by every dummy sequence (their garbage K/V land in pages that are
    # freed afterwards; a sequence never reads a position it has not written).
    pages = worker.allocator.allocate(_SWEEP_ID, context + block)
    features = np.zeros((context, proposer.num_features), np.float32)
    bar = tqdm(total=len(shapes) + len(drafts), desc="precompiling adaptive steps", disable=not progress)
    try:
        for shape in shapes:
            lens = _lens_for(*shape, block)
            out = runner.verify([SeqInput([0] * int(n), context, pages, "all") for n in lens],
                                block_size=max(2, shape[2]))
            ids = [(_SWEEP_ID, i) for i in range(len(lens))]
            for seq_id in ids:
                proposer.add(seq_id, features)
            try:
                nothing = np.zeros(len(ids), np.int64)
                proposer.commit_block(ids, nothing, out.features)
                first_of_bucket = any((shape[0], b) in drafts for b in policy.blocks)
                if first_of_bucket:  # plain steps in a row until the pending rows flush
                    for _ in range(proposer.pending_bucket):
                        proposer.commit_block(ids, nothing, out.features)
                for b in policy.blocks:
                    if (shape[0], b) in drafts:
                        proposer.propose(ids, [0] * len(ids), return_confidence=worker.has_confidence, block_size=b)
                        drafts.discard((shape[0], b))
                        policy.cost.compiled_draft.add((shape[0], b))
                        bar.update()
            finally:
                for seq_id in ids:
                    proposer.release(seq_id)
            policy.cost.compiled_verify.add(shape)
            bar.update()
    finally:
        worker.allocator.free(_SWEEP_ID)
        bar.close()
    return len(shapes) + len(policy.blocks) * len(_powers_up_to(bucket(proposer.max_num_seqs)))


def _powers_up_to(n: int) -> list[int]:
    return [1 << e for e in range(n.bit_length()) if 1 << e <= n]


def _lens_for(s: int, t: int, q: int, max_block: int) -> np.ndarray | None:
    """Block lengths of n sequences (n in the bucket s) whose longest block m is in the bucket q
    (m <= max_block) and whose sum lands in the bucket t (None: no such batch)."""
    low = 1 if t == MIN_TOKEN_ROWS else t // 2 + 1  # sums that bucket to t
    for n in range(s // 2 + 1, s + 1):
        for m in range(q // 2 + 1, min(q, max_block) + 1):
            if m + n - 1 <= t and n * m >= low:
                lens = np.ones(n, np.int64)
                lens[0] = m
                for i in range(1, n):
                    lens[i] += max(0, min(m - 1, low - int(lens.sum())))
                return lens
    return None
