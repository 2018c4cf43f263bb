"""The adaptive DFLASH worker (`--speculative-adaptive`): each decode step chooses, per request,
how many drafts go to the target (`speculative/adaptive.py` decides; docs/adaptive.md).

`forward_decode` reads top to bottom like `DFlashWorker.forward_decode`, with two decisions added:
  0. plan    — which requests to draft at all (none when drafts would not pay for the drafter),
               and the draft block b (2, 4, .. B: a shorter block is a cheaper drafter step);
  1. draft   — the drafter fills the block of b tokens of those requests (b - 1 drafts each),
               with its confidence per draft;
  2. choose  — k_i in 0 .. B-1 drafts per request, maximizing expected tokens per second;
  3. verify  — ONE ragged target step over the blocks [bonus, d_1 .. d_k_i] (k_i = 0: a plain
               decode step), acceptance over exactly the k_i verified drafts;
  4. commit  — the drafter gets the features of the a_i + 1 committed rows (also of undrafted
               requests: their rows wait in its pending buffer), and the policy learns from the
               outcome and the measured step times.
A request that joined where drafts do not pay (`AdaptivePolicy.drafts_may_pay`) has no drafter
context: it is never drafted, its rows are not committed, and a batch of only such requests runs
NONE's step. Where what steps with context realized at a load falls below what context costs
(`AdaptivePolicy.context_lost`), the running requests lose theirs too. Greedy output stays the
target's own; sampling stays lossless (k_i reads q, never the draws).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_backend import SeqInput, compiled_memory, sampling
from jax_backend.batch import bucket
from sgl_dflash.model_executor.forward_batch_info import GenerationBatchResult, ModelWorkerBatch, SamplingBatchInfo
from sgl_dflash.speculative import precompile
from sgl_dflash.speculative.adaptive import GREEDY, SAMPLED, AdaptivePolicy
from sgl_dflash.speculative.cost_model import step_shape
from sgl_dflash.speculative.dflash_worker import DFlashWorker, _draw

logger = logging.getLogger(__name__)


# Where drafts do not pay, every 64th request still gets drafter context, so that the policy
# keeps measuring drafts at that load. Not more often: while one request has context, every step
# of its batch runs the drafting path (plan, commit, learning), ~2% dearer than NONE's at 8; and
# not for long: like any request, it loses context once its own steps with it realized less than
# context costs (`RealizedGains.spent`, after 32 of them).
MEASURED_EVERY = 64
# Verify shapes of up to this many sequences are timed in both layer loops (the rest run the scan).
# At one request the scan made a verify step ~1.5x the plain step (which the tuner runs on the
# switch) against ~1.3x on the switch, and the policy drafted half as often as a fixed block of 4
# paid (docs/adaptive.md, 2026-11-29 night). Not all: each tuned shape is a second program (~400
# mappings, ~8 s to compile on this CPU) that the startup sweep compiles at each swept context;
# up to 2 sequences it is 10 of the 47 shapes at B=8 (a first startup 594 s against 466, with 4
# 756 s), and beyond a few requests this CPU serves plain steps anyway.
TUNED_VERIFY_SEQS = 2
# A step without drafter context is timed for the cost model once in this many (the engine's
# first such step included); the others are NONE's steps with a counter's upkeep.
PLAIN_READ_EVERY = 8


@jax.jit
def _plain_block(features: jax.Array) -> jax.Array:
    """A sampling step's features [S, F] as a plain verify step's [S, 2, F] (row 1 is never
    committed): the drafter's commit then runs the program it runs after a verify."""
    return jnp.pad(features[:, None], ((0, 0), (0, 1), (0, 0)))


class AdaptiveDFlashWorker(DFlashWorker):
    plain_block = staticmethod(_plain_block)  # also run by the startup sweep

    def __init__(self, server_args: Any):
        super().__init__(server_args)
        self.policy = AdaptivePolicy(self.block_size - 1,
                                     prior_acceptance=self.proposer.config.prior_acceptance(self.block_size))
        self.policy.startup_admits = TUNED_VERIFY_SEQS  # past it startup's verify readings are the scan's alone
        self.admitted = 0  # requests prefilled
        self.measuring: set[int] = set()  # slots given context only to keep measuring (`MEASURED_EVERY`)
        self._none_steps = -1  # steps without drafter context (`_none_step`): the first is timed
        # The last drafted step's (n, tokens, seconds, a plain step's predicted seconds, drafted
        # slot -> accepted, undrafted slots with context), handed to the policy's `realized` gains
        # once the drafter's work it left behind is waited for.
        self._drafted_step: tuple | None = None
        # The layer-loop tuner (jax_backend.layout_tuner) times both layouts of the verify shapes of
        # up to TUNED_VERIFY_SEQS sequences; larger ones keep the scan. Plain steps are NONE's
        # decode steps, tuned as NONE's are.
        self.runner.tuned_verify_seqs = TUNED_VERIFY_SEQS
        # A DFlash 2 drafter has no per-draft logits: its requests go by their recent acceptance.
        self.has_confidence = not self.proposer.config.is_dflash2
        # Most steps commit 1 or 2 rows per request (a plain step, a verify of one draft): drafts
        # read 2 pending rows, not the full block's (batch 32: ~6 ms of a ~50 ms draft).
        self.proposer.draft_pending_rows = min(2, self.proposer.pending_bucket)
        # Cached prefixes in the target's first two context buckets (up to 256 and 512 tokens:
        # a chat prompt and its answer) that fit the context and the KV pool.
        room = min(server_args.context_length, self.allocator.num_free_pages * self.allocator.page_size)
        contexts = [c for c in precompile.SWEPT_CONTEXTS if c + self.block_size <= room]
        if not server_args.disable_precompile and contexts:
            precompile.sweep(self, contexts=contexts)
        self._check_program_room()

    def forward_extend(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        """The target's prefill; a request gets drafter context (the drafter's ingest runs on
        behind the host) where drafts may pay at the load it joins (`drafts_may_pay`), and every
        `MEASURED_EVERY`-th request anyway. One without it is served as NONE serves it."""
        self._realize(0.0)  # the next wait is the prompts' ingest, not the last step's
        # Priced at the context these requests decode at: what is compiled there (else at the last
        # step's, or none: a fresh engine's first batch of 32 read a compile into every program).
        contexts = [prefix + len(ids) for prefix, ids in zip(batch.prefix_lens, batch.input_ids)]
        self.policy.cost.at(self.runner.context_pages(contexts), self.proposer.window(max(contexts)))
        may_pay = self.policy.drafts_may_pay(len(self.policy.requests) + len(batch.slots))
        admitted = range(self.admitted + 1, self.admitted + len(batch.slots) + 1)
        context = [may_pay or i % MEASURED_EVERY == 0 for i in admitted]
        # Without any, NONE's prefill: no features computed or copied (2-4% of a batch of 32's),
        # a second program per prompt shape; near the process's mapping limit, one per shape.
        features = any(context) or not self.policy.may_compile
        result, out = self.target_worker.forward_extend(batch, features=features)
        result.num_draft_tokens = self.block_size - 1
        for i, (slot, temperature) in enumerate(zip(batch.slots, batch.sampling_info.temperatures)):
            self.admitted += 1
            if context[i]:
                self.add_context(slot, out.features[i])
                if not may_pay:
                    self.measuring.add(slot)
            self.policy.add(slot, SAMPLED if temperature > 0 else GREEDY)
        return result

    def release(self, slot: int) -> None:
        super().release(slot)
        self.policy.release(slot)

    def _release_drafter(self, slot: int) -> None:
        super()._release_drafter(slot)
        self.policy.realized.forget(slot)
        self.measuring.discard(slot)

    def forward_decode(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        if self._drafted_step is None and self.drafting.isdisjoint(batch.slots):
            return self._none_step(batch)  # no request has drafter context: NONE's step
        B, n, slots = self.block_size, len(batch.slots), batch.slots
        bonus = [ids[0] for ids in batch.input_ids]
        info = batch.sampling_info
        modes = (info.temperatures > 0).astype(np.int64)
        compiled = self.compilations()
        # What is left of the drafter's work that ran behind the scheduler: the last drafted step's.
        self._realize(self._wait_for_drafter())
        t0 = time.perf_counter()
        draftable = np.array([slot in self.drafting for slot in slots])
        if draftable.any():
            # What steps with drafter context realized at this load is below what context costs:
            # these requests go on as NONE serves them, but those kept to measure it; and so does
            # a request whose own steps with context realized less (`RealizedGains.spent`).
            lost, realized = self.policy.context_lost(n), self.policy.realized
            for slot in [slot for slot, d in zip(slots, draftable) if d]:
                if (lost and slot not in self.measuring) or realized.spent(slot, self.policy.context_cost):
                    self._release_drafter(slot)
            draftable = np.array([slot in self.drafting for slot in slots])
        if not draftable.any():  # no request has drafter context left: NONE's step
            return self._none_step(batch)

        # 0.-1. Plan and draft: only the requests whose drafts may pay (and probes), `block` tokens,
        # knowing what is compiled at this context (the target's page-table width, the drafter's
        # window).
        context = [slot for slot, d in zip(slots, draftable) if d]
        self.policy.cost.at(self.runner.context_pages(batch.prefix_lens), self.proposer.read_len(context))
        plan = self.policy.plan_drafts(slots, draftable)
        drafted, block = plan.drafted, plan.block
        # What a drafted step's gain is read against (predicted before the step runs).
        plain_seconds = self.policy.plain_seconds(n) if drafted.any() else 0.0
        rows, width = np.flatnonzero(drafted), plan.block - 1  # width: drafts per drafted request
        drafts = np.zeros((n, B - 1), np.int32)
        confidence = np.zeros((n, B - 1), np.float32) if self.has_confidence else None
        q = None  # sampling: the drafted rows' q [bucket(len(rows)), b-1, V]
        t1 = time.perf_counter()
        if len(rows):
            draft_slots, draft_bonus = [slots[i] for i in rows], [bonus[i] for i in rows]
            if info.is_all_greedy and self.has_confidence:
                drafts[rows, :width], confidence[rows, :width] = self.proposer.propose(
                    draft_slots, draft_bonus, return_confidence=True, block_size=block)
            elif info.is_all_greedy:
                drafts[rows, :width] = self.proposer.propose(draft_slots, draft_bonus, block_size=block)
            elif not self.has_confidence:  # DFlash 2: the selector samples its path, q over K candidates
                from torchax_proposer import dense_draft_probs

                path = self.proposer.propose_path(draft_slots, draft_bonus, temperatures=info.temperatures[rows],
                                                  key=self.target_worker.next_key(), block_size=block)
                drafts[rows, :width] = path.tokens
                q = dense_draft_probs(path.candidates, path.probs, self.vocab_size, rows=bucket(len(rows)))
            else:
                _, logits = self.proposer.propose(draft_slots, draft_bonus, return_logits=True, block_size=block)
                q, drafts[rows, :width], confidence[rows, :width] = self._sample_drafts_scored(
                    np.asarray(logits), info.select(rows))
        t2 = time.perf_counter()

        # 2. Choose k_i; 3. verify the ragged blocks in one step, the acceptance padded to the
        # shape's block bucket Q (a function of the verify shape: no extra compiled programs).
        verified = (self.policy.choose(slots, modes, drafted, confidence, t2 - t1, block) if len(rows)
                    else np.zeros(n, np.int64))
        shape = step_shape(verified + 1)
        if not verified.any():  # no draft to verify: NONE's own sampling program, not waited for
            accepted, new_bonus, features = self._plain_step(batch, bonus)
        else:
            accept_width = max(2, shape[2])
            seqs = [SeqInput([bonus[i], *drafts[i, : verified[i]]], batch.prefix_lens[i], batch.page_tables[i], "all")
                    for i in range(n)]
            if info.is_all_greedy:
                out = self.runner.verify(seqs, block_size=accept_width)
            else:
                draft_probs = _place_rows(q, rows, bucket(n), accept_width - 1)
                out = self.runner.verify(seqs, info.temperatures, info.top_ps, info.top_ks, draft_probs=draft_probs,
                                         key=self.target_worker.next_key(), block_size=accept_width)
            accepted, new_bonus, features = out.accepted, out.bonus, out.features

        # 4. Commit the a+1 rows of every request; learn from the outcome and the step's times.
        # A plain step's outcome (nothing accepted) is known before its device work ends: this
        # host work (~1 ms, 2-3% of a step at one request) then runs while the device steps, and
        # the step's reading below is its wall time either way.
        self.proposer.commit_block([s if d else None for s, d in zip(slots, draftable)], accepted, features)
        self.policy.observe(slots, modes, drafted, confidence, verified, accepted, block)
        new_bonus = np.asarray(new_bonus)[:n]
        if not verified.any():
            self.runner.step_read()  # the plain step's time, host work overlapped, to the layer-loop tuner
        t3 = time.perf_counter()
        tokens = np.concatenate([drafts, np.zeros((n, 1), np.int32)], axis=1)
        tokens[np.arange(n), accepted] = new_bonus
        t4 = time.perf_counter()
        if self.compilations() == compiled:
            self.policy.cost.observe(shape, t3 - t2, len(rows), t2 - t1, (t1 - t0) + (t4 - t3),
                                     draft_block=block)
            if len(rows):
                self._drafted_step = (n, int(accepted.sum()) + n, t4 - t0, plain_seconds,
                                      {slots[i]: int(accepted[i]) for i in rows},
                                      [s for s, d, r in zip(slots, draftable, drafted) if d and not r])
            else:
                self.policy.realized.plain(n)
                self.policy.realized.request_step(dict.fromkeys(context, 0.0))
        else:  # a step that compiled measures the compiler
            self.policy.cost.compiled(shape, len(rows), block, t4 - t0)
            self._check_program_room()
        # "verify" holds the commit and the learning too (on a plain step they overlap it)
        for phase, seconds in (("draft", t2 - t0), ("verify", t3 - t2), ("commit", t4 - t3)):
            self.timings[phase] += seconds
        self.timings["steps"] += 1
        self.timings["drafted_steps"] += bool(len(rows))
        return GenerationBatchResult(tokens, accepted.astype(np.int32) + 1, accept_lens=accepted,
                                     num_draft_tokens=B - 1, verify_lens=verified.astype(np.int32))

    def _none_step(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        """A step of requests without drafter context: NONE's decode step, and no more upkeep than
        a counter, but every `PLAIN_READ_EVERY`-th step, which is timed as the plain step it is
        (the cost model's plain reading stays fresh for the next admission). With the upkeep on
        every step it ran 1.03-1.06x NONE's step at one request (~0.3 ms of ~9.5) and 1.02x at 8."""
        n, cost = len(batch.slots), self.policy.cost
        self.policy.realized.without_context(n)  # (evidence that context does not pay here expires)
        self._none_steps += 1
        t0 = time.perf_counter()
        if self._none_steps % PLAIN_READ_EVERY:
            result = self.target_worker.forward_decode(batch)
        else:
            compiled = self.compilations()
            cost.at(self.runner.context_pages(batch.prefix_lens), self.proposer.read_len([]))
            t0 = time.perf_counter()
            result = self.target_worker.forward_decode(batch)
            seconds, shape = time.perf_counter() - t0, step_shape(np.ones(n, np.int64))
            if self.compilations() == compiled:  # the host work of a step with drafts is not here: kept
                cost.observe(shape, seconds, 0, 0.0, cost.overhead)
            else:
                cost.compiled(shape, 0, 0, seconds)
                self._check_program_room()
        self.timings["verify"] += time.perf_counter() - t0
        self.timings["steps"] += 1
        result.accept_lens = result.verify_lens = np.zeros(n, np.int32)
        result.num_draft_tokens = self.block_size - 1
        return result

    def _plain_step(self, batch: ModelWorkerBatch, bonus: list[int]) -> tuple[np.ndarray, jax.Array, jax.Array]:
        """One token per request through the target's sampling program, NONE's decode step,
        dispatched and not waited for: (accepted = 0, the device's tokens [bucket(n)], the
        drafter's features as a plain verify step's [S, 2, F]).
        A verify of one-token blocks does the same work but ran ~3% slower at 32 requests on
        XLA:CPU (plain step with the drafter's commit, interleaved: 172.2 vs 166.4 ms)."""
        n, info = len(batch.slots), batch.sampling_info
        out = self.runner.sample(
            [SeqInput([bonus[i]], batch.prefix_lens[i], batch.page_tables[i]) for i in range(n)],
            info.temperatures, info.top_ps, info.top_ks, None if info.is_all_greedy else self.target_worker.next_key(),
            device_features=True, wait=False)
        return np.zeros(n, np.int32), out.tokens, self.plain_block(out.device_features)

    def _realize(self, waited: float) -> None:
        """Hands the last drafted step to the policy's `realized` gains, with the `waited` seconds
        of its drafter work that ran on behind the scheduler."""
        if self._drafted_step is not None:
            n, tokens, seconds, plain_seconds, accepted, undrafted = self._drafted_step
            realized = self.policy.realized
            realized.drafted(n, tokens, seconds + waited, plain_seconds)
            gains = realized.request_gains(n, accepted, seconds + waited, plain_seconds) | dict.fromkeys(undrafted, 0.0)
            # (a request released since has nothing more to read; its slot may be a new one's)
            realized.request_step({slot: gain for slot, gain in gains.items() if slot in self.drafting})
            self._drafted_step = None

    def _wait_for_drafter(self) -> float:
        """The drafter's work runs asynchronously: its commit and a prompt's ingest overlap the
        scheduler's host work between steps, and what is left is waited for before a decode
        step's clock starts. Left running into the step, it was timed as the step's verify (batch
        32: the first plain steps read 351 ms against ~180 after the prompts' ingest), and the
        policy took plain steps for dearer than they are. The seconds waited."""
        start = time.perf_counter()
        jax.block_until_ready((self.proposer.k_cache, self.proposer.pending))
        return time.perf_counter() - start

    def _check_program_room(self) -> None:
        """Stops the policy from compiling drafted programs near the process's mapping limit
        (jax_backend.compiled_memory): what is compiled keeps serving, a compile past it kills."""
        room = compiled_memory.program_room()
        may_compile = room is None or room > precompile.SERVING_PROGRAMS
        if self.policy.may_compile and not may_compile:
            logger.warning("room for %s more compiled programs (vm.max_map_count=%s): the adaptive policy "
                           "keeps to the programs compiled so far; raise vm.max_map_count to let it compile more",
                           room, compiled_memory.map_limit())
        self.policy.may_compile = may_compile

    def compilations(self) -> int:
        """Programs compiled so far by anything a decode step runs (a step that compiled is not a
        measurement of the step). JAX's process-wide trace count (`jax_backend.compile_counter`)
        was tried instead: in its one full run the policy drafted 65% of the steps at 8 requests
        (0.88x NONE) where it had run 95% plain; not kept (2026-11-29 afternoon, docs/adaptive.md)."""
        helpers = (_confidence, _gather_rows, _draw, sampling._plain_probs, sampling._filtered_probs)
        return self.num_compilations() + sum(fn._cache_size() for fn in helpers)

    def _sample_drafts_scored(self, draft_logits: np.ndarray, info: SamplingBatchInfo) -> tuple[jax.Array, np.ndarray, np.ndarray]:
        """`_sample_drafts` plus each draft position's confidence: max q for a sampled request,
        the plain softmax's max for a greedy one (whose q is one-hot). A function of q only,
        never of the draws, so that choosing k from it keeps rejection sampling exact."""
        n, gamma, vocab = draft_logits.shape
        q, sampled, padded, temperature = self._draw_drafts(draft_logits, info)
        confidence = np.asarray(_confidence(q.reshape(-1, vocab), padded, temperature)).reshape(-1, gamma)[:n]
        return q, sampled, confidence


@jax.jit
def _confidence(q: jax.Array, logits: jax.Array, temperature: jax.Array) -> jax.Array:
    plain = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
    return jnp.where(temperature > 0, jnp.max(q, axis=-1), plain)


def _place_rows(q: jax.Array, rows: np.ndarray, num_rows: int, width: int) -> jax.Array:
    """q [bucket(len(rows)), b-1, V] of the drafted requests (a draft block of b) -> [num_rows,
    width, V] in batch order, for an acceptance `width` drafts wide (undrafted rows and positions
    past the draft block zero, positions past the width dropped: none of them is verified, so that
    q is never read)."""
    if q.shape[:2] == (num_rows, width) and np.array_equal(rows, np.arange(len(rows))):
        return q  # every request drafted, in order, at the acceptance's width
    index = np.full(num_rows, q.shape[0], np.int32)  # the appended zero row
    index[rows] = np.arange(len(rows))
    return _gather_rows(q, index, width)


@functools.partial(jax.jit, static_argnums=2)
def _gather_rows(q: jax.Array, index: jax.Array, width: int) -> jax.Array:
    q = jnp.pad(q, ((0, 1), (0, max(0, width - q.shape[1])), (0, 0)))
    return q[index, :width]
