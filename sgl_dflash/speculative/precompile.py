"""The adaptive worker's startup sweep: compile, before the first request, every program its policy
can choose at a request's first two context buckets.

Why: the policy picks ragged verify shapes (S sequences, T rows, Q longest block: 47 of them up to
32 requests at B=8) and draft programs (drafter batch x draft block 2, 4, .. B). A fresh engine that
met them while serving stalled a step for each (1-5 s on a CPU): 13 of a 27 s first pass at batch
8 (docs/adaptive.md). Each is compiled per context bucket (the target's page-table width, the
drafter's window), so a chat answer that grows past 256 tokens of context met them all again. SGLang
captures its CUDA graphs per batch size at startup for the same reason. With the persistent
compilation cache a later startup mostly loads them.

How: dummy sequences sharing one allocated page table (freed afterwards) and drafter sequences
added with zero features, then released. At the first swept context each program runs 3 more
times, timed, and the cost model prices a program no step has run yet from that median, scaled by
what served programs read over their own (`CostModel.startup_reading`): without readings a load
not served yet was predicted from a line through the shapes served, and after single requests
that line put a batch of 8's drafted steps above the plain step's rate where they ran below it
(docs/adaptive.md, 2026-12-04). Greedy programs at `SWEPT_CONTEXTS` (cached prefixes in
the target's buckets of 256 and 512 tokens; the drafter's windows of 128, 256 and 512) and the
drafter's prompt chunks are swept; sampling modes, longer contexts and the target's prefill shapes
still compile when first met (the policy knows which: `CostModel.at`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jax_backend import SeqInput, compiled_memory
from jax_backend.batch import bucket
from sgl_dflash.speculative.cost_model import MIN_TOKEN_ROWS, step_shape


# A cached prefix in each of the target's first context buckets (3/4 of 256 and 512 tokens).
SWEPT_CONTEXTS = (192, 384)
# Programs left room for after the sweep (jax_backend.compiled_memory): prefill chunks, sampling,
# plain steps and drafted shapes at longer contexts. A context is swept only if this much room
# stays after it; with Linux's default limit one engine sweeps both contexts, a second adaptive
# engine in the same process none.
SERVING_PROGRAMS = 64

logger = logging.getLogger(__name__)

_SWEEP_ID = "precompile"
_SHORT_ID = ("precompile", "short")


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


def sweep(worker: Any, *, contexts: Sequence[int], progress: bool = True) -> None:
    """Runs, on `worker` (an AdaptiveDFlashWorker with no requests), at each of `contexts` (cached
    prefix lengths, one per target context bucket), every verify shape with the drafter's commit
    of its features (the pending-row write; per batch bucket also the flush that plain steps in a
    row end in), every draft program (batch bucket x draft block; in the first bucket at both
    drafter windows) and, per batch bucket, the greedy sampling programs that steps verifying no
    draft run (with the drafter's features, and NONE's without); the policy's cost model learns
    they are compiled."""
    runner, proposer, policy = worker.runner, worker.proposer, worker.policy
    block = worker.block_size
    shapes = verify_shapes(proposer.max_num_seqs, block)
    plain_batches = _powers_up_to(bucket(proposer.max_num_seqs))  # the drafter's batch buckets too
    all_drafts = {(rows, b) for rows in plain_batches for b in policy.blocks}
    per_context = len(shapes) + len(all_drafts) + len(plain_batches)
    # A shape the runner's tuner times compiles its switch program too, ~1.5 programs' mappings
    # (SmolLM2: 20 of them took 7,542, docs/adaptive.md 2026-11-29 night)
    switched = sum(shape[0] <= runner.tuned_verify_seqs for shape in shapes) + len(plain_batches)
    programs = per_context + (3 * switched + 1) // 2
    room = compiled_memory.program_room()
    if room is not None and room < len(contexts) * programs + SERVING_PROGRAMS:
        kept = max(0, (room - SERVING_PROGRAMS) // programs)
        logger.warning("room for %d more compiled programs (vm.max_map_count=%s): precompiling %d of %d "
                       "contexts; the rest compile when first met", room, compiled_memory.map_limit(),
                       kept, len(contexts))
        contexts = contexts[:kept]
    if not contexts:
        return
    # One real page table shared by every dummy sequence (their garbage K/V land in pages that are
    # freed afterwards; a sequence never reads a position it has not written).
    pages = worker.allocator.allocate(_SWEEP_ID, max(contexts) + block)
    bar = tqdm(total=len(contexts) * per_context, desc="precompiling adaptive steps", disable=not progress)
    try:
        _drafter_prefills(proposer)
        for context in contexts:
            timed = context == contexts[0]
            policy.cost.at(runner.context_pages([context]), 0)
            features = np.zeros((context, proposer.num_features), np.float32)
            # The drafter's window has two buckets inside the target's first one (128 and 256
            # tokens): there, drafts run for the `context` prefix and for a short one too.
            short = context == contexts[0] and context > proposer.min_read_len // 2
            drafts = set(all_drafts)
            for shape in shapes:
                lens = _lens_for(*shape, block)
                seqs = [SeqInput([0] * int(n), context, pages, "all") for n in lens]
                start = time.perf_counter()
                out = runner.verify(seqs, block_size=max(2, shape[2]))
                policy.cost.observe_compile(time.perf_counter() - start)  # what a compile costs here
                if timed:
                    _time(worker, "verify", shape, lambda: runner.verify(seqs, block_size=max(2, shape[2])).features)
                ids = [(_SWEEP_ID, i) for i in range(len(lens))]
                first_of_bucket = any((shape[0], b) in drafts for b in policy.blocks)
                windows = _commit_and_draft(worker, ids, features, out.features, flush_and_draft=first_of_bucket,
                                            timed=timed)
                if first_of_bucket and short:
                    windows += _commit_and_draft(worker, [_SHORT_ID + (i,) for i in range(len(ids))],
                                                 features[: proposer.min_read_len // 2], out.features,
                                                 flush_and_draft=True)
                for b in policy.blocks if first_of_bucket else ():
                    drafts.discard((shape[0], b))
                    for window in windows:
                        policy.cost.drafts_compiled_at(window).add((shape[0], b))
                    bar.update()
                policy.cost.compiled_verify.add(shape)
                bar.update()
            for n in plain_batches:  # a step that verifies no draft runs the greedy sampling program
                # as the worker's: not waited for, then reported read (its first step compiles
                # every layer loop the runner's tuner times)
                def plain_step(n=n):
                    out = runner.sample([SeqInput([0], context, pages)] * n, [0.0] * n, [1.0] * n, [0] * n,
                                        device_features=True, wait=False)
                    features = worker.plain_block(out.device_features)
                    np.asarray(out.tokens)
                    runner.step_read()
                    return features

                plain_step()
                if timed:
                    _time(worker, "verify", step_shape(np.ones(n, np.int64)), plain_step)
                bar.update()
        _none_programs(runner, contexts, pages, plain_batches)
    finally:
        worker.allocator.free(_SWEEP_ID)
        bar.close()


def _none_programs(runner: Any, contexts: Sequence[int], pages: Any, batches: list[int]) -> None:
    """NONE's program per batch bucket at each swept context, where room for programs is left
    (after the drafted shapes, which it must not crowd out): steps of requests without drafter
    context run it (every request at a load where context does not pay, or once its own did not),
    and met first mid-answer, its layer loops compiled for 1-4 s of a batch's 7-20 s."""
    for context in contexts:
        room = compiled_memory.program_room()
        if room is not None and room < SERVING_PROGRAMS + 2 * len(batches):  # (two layer loops each)
            return
        for n in batches:
            runner.sample([SeqInput([0], context, pages)] * n, [0.0] * n, [1.0] * n, [0] * n, features=False)


def _drafter_prefills(proposer: Any) -> None:
    """A prompt's features go to the drafter in chunks of every power-of-two size up to its
    prefill chunk: one program each (0.5 s of a first batch of 8 prompts compiled them)."""
    rows = max(proposer.pending_bucket, proposer.min_prefill_rows)
    while rows <= proposer.prefill_chunk:
        proposer.add(_SWEEP_ID, np.zeros((rows, proposer.num_features), np.float32))
        proposer.release(_SWEEP_ID)
        rows *= 2


def _time(worker: Any, name: str, key: tuple, run, repeats: int = 3) -> None:
    """Runs `run` (compiled already) `repeats` times, waiting for what it returns, and hands the
    median seconds to the cost model as `key`'s startup reading (one run alone read a batch of 8's
    2-token verify at 2.1x its plain step, another run 1.3x); not if a run compiled something (the
    runner's layer-loop tuner may pick a layout it has not run yet)."""
    compiled, seconds = worker.compilations(), []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        seconds.append(time.perf_counter() - start)
    if worker.compilations() == compiled:
        worker.policy.cost.startup_reading(name, key, statistics.median(seconds))


def _commit_and_draft(worker: Any, ids: list, context_features: np.ndarray, verified: Any, *,
                      flush_and_draft: bool, timed: bool = False) -> list[int]:
    """Adds `ids` with `context_features`, commits the verify step's features (a plain step); with
    `flush_and_draft`, also the plain steps in a row that end in a flush of the pending rows, and a
    draft of every block (`timed`: each draft 3 more times, timed for the cost model); then releases
    them. Returns the drafter windows drafted at."""
    proposer = worker.proposer
    for seq_id in ids:
        proposer.add(seq_id, context_features)
    try:
        nothing = np.zeros(len(ids), np.int64)
        for _ in range(1 + (proposer.pending_bucket if flush_and_draft else 0)):
            proposer.commit_block(ids, nothing, verified)
        if not flush_and_draft:
            return []
        window = proposer.read_len(ids)
        for b in worker.policy.blocks:
            def draft(b=b):
                return proposer.propose(ids, [0] * len(ids), return_confidence=worker.has_confidence, block_size=b)

            draft()
            if timed:
                _time(worker, "draft", (bucket(len(ids)), b), draft)
        return [window]
    finally:
        for seq_id in ids:
            proposer.release(seq_id)


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
