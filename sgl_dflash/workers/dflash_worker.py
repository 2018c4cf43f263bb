"""The DFLASH worker: block-diffusion speculative decoding over the JAX target.

Per decode step, for the whole batch at once (`decode` reads top to bottom):
  1. draft   — the drafter fills the block [bonus, MASK x (B-1)] at positions L .. L+B-1 of every
               request in one forward (B-1 drafts each);
  2. verify  — ONE ragged target forward over all B-token blocks, returning logits and the aux
               hidden states of the drafter's target layers;
  3. accept  — greedy prefix match, or rejection sampling for temperature > 0 (draft and target
               probabilities through the same temperature / top-p / top-k transform);
  4. commit  — the target's committed length becomes L + a + 1 (rejected K/V slots are simply
               overwritten later) and the drafter receives the aux rows of exactly those a + 1
               tokens; stop rules may cut the accepted tokens, which finishes the request.
L (`Req.committed_len`) counts only verified tokens: neither the target KV nor the drafter ever
counts an unverified draft.

Context features are z-lab's `hidden_states[l + 1]` for each target layer l: the layer's output,
except for the LAST layer, where transformers (and so z-lab's drafters and our trainer) report it
after the final norm (`TargetRunner.hidden_state_features`).
"""

from __future__ import annotations

import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from jax_backend import SeqInput, sampling
from jax_backend.batch import bucket
from sgl_dflash.schedule_batch import Req
from sgl_dflash.server_args import ServerArgs, ServerArgsError, read_model_config, read_token_map
from sgl_dflash.workers.ar_worker import DEVICE_STEPS, AppendFn, ARWorker, sampling_arrays


def _target_config_dict(server_args: ServerArgs) -> dict:
    config = read_model_config(server_args.model_path, "--model-path")
    return {key: config[key] for key in ("hidden_size", "vocab_size", "num_hidden_layers")}


def validate_dflash_server_args(server_args: ServerArgs) -> None:
    """Refuse a drafter that does not fit the target or the block size; default the block size."""
    from torchax_proposer import DraftCheckpointError, read_draft_config

    path = server_args.speculative_draft_model_path
    if not path:
        raise ServerArgsError("--speculative-algorithm DFLASH needs --speculative-draft-model-path")
    read_model_config(path, "--speculative-draft-model-path")
    try:
        draft = read_draft_config(path, _target_config_dict(server_args))
    except DraftCheckpointError as e:
        raise ServerArgsError(f"--speculative-draft-model-path {path!r} does not fit the target: {e}") from e
    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = draft.block_size
    block = server_args.speculative_num_draft_tokens
    if isinstance(block, bool) or not isinstance(block, int) or not 2 <= block <= draft.block_size:
        raise ServerArgsError(
            f"--speculative-num-draft-tokens must be an integer in [2, {draft.block_size}] (the "
            f"drafter's block_size), got {block!r}"
        )
    if server_args.speculative_token_map is not None:
        read_token_map(server_args.speculative_token_map, draft.vocab_size)


class DFlashWorker(ARWorker):
    def __init__(self, server_args: ServerArgs):
        from torchax_proposer import DFlashProposer, read_draft_config

        target_config = _target_config_dict(server_args)
        draft_config = read_draft_config(server_args.speculative_draft_model_path, target_config)
        self.block_size = server_args.speculative_num_draft_tokens or draft_config.block_size
        self.tokens_per_step = self.block_size  # a verify block writes B KV slots
        super().__init__(server_args, aux_layer_ids=draft_config.target_layer_ids)
        self.proposer = DFlashProposer(
            server_args.speculative_draft_model_path,
            target_embed=self.target.embed,
            target_lm_head=self.target.lm_head,
            target_config=target_config,
            max_num_seqs=server_args.max_running_requests,
            max_context_len=server_args.context_length + self.block_size,
            block_size=self.block_size,
            dtype=server_args.resolved_dtype,
            token_map=(None if server_args.speculative_token_map is None
                       else read_token_map(server_args.speculative_token_map, draft_config.vocab_size)),
        )
        self.drafting: set[int] = set()  # slots with drafter state
        self.timings: dict[str, float] = defaultdict(float)  # seconds per phase, for benchmarks

    def prefill(self, reqs: list[Req], append: AppendFn):
        """Target prefill (first token = the first bonus) and the drafter's context features."""
        out = super().prefill(reqs, append)
        for req, features in zip(reqs, out.aux_hidden):
            self._release_drafter(req.slot)  # only set when a failed batch is being retried
            self.proposer.add(req.slot, self.target.hidden_state_features(features))
            self.drafting.add(req.slot)
            req.init_spec_stats(self.block_size - 1)
        return out

    def decode(self, reqs: list[Req], append: AppendFn) -> None:
        B, n = self.block_size, len(reqs)
        slots = [r.slot for r in reqs]
        bonus = [r.last_token for r in reqs]
        greedy = all(r.sampling_params.is_greedy for r in reqs)
        t0 = time.perf_counter()

        # 1. Draft: B-1 tokens per request from one drafter forward over all blocks.
        if greedy:
            drafts = self.proposer.propose(slots, bonus)
        else:
            drafts, draft_logits = self.proposer.propose(slots, bonus, return_logits=True)
            draft_probs, drafts = self._sample_drafts(np.asarray(draft_logits), reqs)
        drafts = np.asarray(drafts, np.int32)
        t1 = time.perf_counter()
        if DEVICE_STEPS:  # 2.-4. with acceptance inside the target's jitted step
            return self._verify_on_device(reqs, append, bonus, drafts, None if greedy else draft_probs, t0, t1)

        # 2. Verify: one target forward over every [bonus, drafts...] block at positions L.. .
        out = self.target.forward([
            SeqInput([bonus[i], *drafts[i]], r.committed_len, self.page_table(r), "all")
            for i, r in enumerate(reqs)
        ])
        t2 = time.perf_counter()

        # 3. Accept: a[i] drafts pass, then one token from the target (the new bonus).
        rows = bucket(n)
        padded_drafts = np.zeros((rows, B - 1), np.int32)
        padded_drafts[:n] = drafts
        target_logits = np.zeros((rows, B, self.vocab_size), np.float32)
        target_logits[:n] = np.stack(out.logits)
        if greedy:
            accepted, new_bonus = sampling.greedy_accept(padded_drafts, target_logits)
        else:
            # Greedy rows ride along exactly: temperature 0 gives one-hot p and q, and rejection
            # sampling with one-hot distributions is the greedy prefix match.
            temperature, top_p, top_k = sampling_arrays(reqs, rows * B, repeat=B)
            target_probs = sampling.probs(target_logits.reshape(rows * B, -1), temperature, top_p, top_k)
            accepted, new_bonus = sampling.rejection_accept(
                padded_drafts, draft_probs, target_probs.reshape(rows, B, -1), self.next_key()
            )
        accepted, new_bonus = np.asarray(accepted)[:n], np.asarray(new_bonus)[:n]
        t3 = time.perf_counter()

        # 4. Commit: the drafter gets the aux rows of exactly the a+1 committed tokens (the old
        # bonus and the accepted drafts); the target's committed length moves with the output.
        self.proposer.commit(slots, [int(a) for a in accepted], [
            self.target.hidden_state_features(out.aux_hidden[i])[: a + 1] for i, a in enumerate(accepted)
        ])
        for i, r in enumerate(reqs):
            a = int(accepted[i])
            r.record_verify(B - 1, a)
            append(r, [*drafts[i, :a].tolist(), int(new_bonus[i])])  # stop rules may cut this
        t4 = time.perf_counter()
        for phase, seconds in (("draft", t1 - t0), ("verify", t2 - t1), ("accept", t3 - t2), ("commit", t4 - t3)):
            self.timings[phase] += seconds
        self.timings["steps"] += 1

    def _verify_on_device(self, reqs, append, bonus, drafts, draft_probs, t0, t1) -> None:
        """Steps 2-4 of `decode` through TargetRunner.verify: verify and accept in one jitted
        step (only accepted counts and bonus ids come to the host); the drafter takes the block
        features as they are on the device."""
        B, slots = self.block_size, [r.slot for r in reqs]
        seqs = [SeqInput([bonus[i], *drafts[i]], r.committed_len, self.page_table(r), "all") for i, r in enumerate(reqs)]
        if draft_probs is None:
            out = self.target.verify(seqs)
        else:
            out = self.target.verify(seqs, *sampling_arrays(reqs, len(reqs)), draft_probs=draft_probs, key=self.next_key())
        t2 = time.perf_counter()
        self.proposer.commit_block(slots, out.accepted, out.features)
        for i, r in enumerate(reqs):
            a = int(out.accepted[i])
            r.record_verify(B - 1, a)
            append(r, [*drafts[i, :a].tolist(), int(out.bonus[i])])  # stop rules may cut this
        t3 = time.perf_counter()
        for phase, seconds in (("draft", t1 - t0), ("verify", t2 - t1), ("accept", 0.0), ("commit", t3 - t2)):
            self.timings[phase] += seconds
        self.timings["steps"] += 1

    def _sample_drafts(self, draft_logits: np.ndarray, reqs: list[Req]) -> tuple[jax.Array, np.ndarray]:
        """Draft tokens ~ q, with q the same transform of the draft logits as the target's p.

        Returns q [rows, B-1, V] (bucketed rows) and the drafts [n, B-1]."""
        n, gamma, vocab = draft_logits.shape
        rows = bucket(n)
        padded = np.zeros((rows * gamma, vocab), np.float32)
        padded[: n * gamma] = draft_logits.reshape(n * gamma, vocab)
        temperature, top_p, top_k = sampling_arrays(reqs, rows * gamma, repeat=gamma)
        q = sampling.probs(padded, temperature, top_p, top_k)
        sampled = np.asarray(_draw(q, self.next_key())).reshape(rows, gamma)[:n]
        return q.reshape(rows, gamma, vocab), sampled

    def release(self, slot: int) -> None:
        super().release(slot)
        self._release_drafter(slot)

    def _release_drafter(self, slot: int) -> None:
        if slot in self.drafting:
            self.proposer.release(slot)
            self.drafting.discard(slot)

    def committed_lens(self, reqs: list[Req]) -> list[tuple[int, int]]:
        """(target committed length, drafter committed length) per request, for invariant checks."""
        return [(r.committed_len, self.proposer.committed_len(r.slot)) for r in reqs]

    def num_compilations(self) -> int:
        return self.target.num_compilations() + self.proposer.num_compilations()


@jax.jit
def _draw(probs: jax.Array, key: jax.Array) -> jax.Array:
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
