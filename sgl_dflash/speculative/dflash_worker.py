"""The DFLASH worker: block-diffusion speculative decoding over the JAX target.

It composes a target worker (the JAX target runner and its sampling) and a proposer (the torchax
drafter). Per decode step, for the whole batch at once (`forward_decode` reads top to bottom):
  1. draft   — the drafter fills the block [bonus, MASK x (B-1)] at positions L .. L+B-1 of every
               request in one forward (B-1 drafts each);
  2. verify  — ONE ragged target forward over all B-token blocks, returning logits and the aux
               hidden states of the drafter's target layers;
  3. accept  — greedy prefix match, or rejection sampling for temperature > 0 (draft and target
               probabilities through the same temperature / top-p / top-k transform; a DFlash 2
               drafter samples its selector's path, and q is its distribution over K candidates);
  4. commit  — the drafter receives the aux rows of exactly the a + 1 committed tokens; the step
               returns those tokens (a drafts + the new bonus) per request, and the scheduler
               moves the committed length to L + a + 1 (rejected K/V slots are simply overwritten
               later); its stop rules may cut the tokens, which finishes the request.
L (the batch's `prefix_lens`) counts only verified tokens: neither the target KV nor the drafter
ever counts an unverified draft.

Context features are z-lab's `hidden_states[l + 1]` for each target layer l: the layer's output,
except for the LAST layer, where transformers (and so z-lab's drafters and our trainer) report it
after the final norm (`TargetRunner.hidden_state_features`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_backend import SeqInput, cpu_kernels, greedy_head, sampling
from jax_backend.batch import bucket
from sgl_dflash.errors import ServerArgsError
from sgl_dflash.model_config import read_model_config, target_dims
from sgl_dflash.model_executor.forward_batch_info import (
    ForwardMode,
    GenerationBatchResult,
    ModelWorkerBatch,
    SamplingBatchInfo,
    TokenScores,
)
from sgl_dflash.model_executor.target_worker import TargetWorker

logger = logging.getLogger(__name__)


def validate_dflash_server_args(server_args, algorithm: str = "DFLASH") -> None:
    """Refuse a drafter that does not fit the target or the block size; default the block size.
    Reads only SGLang's field names, so SGLang's ServerArgs passes too (the plugin's check)."""
    from torchax_proposer import DraftCheckpointError, read_draft_config

    path = getattr(server_args, "speculative_draft_model_path", None)
    if not path:
        raise ServerArgsError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path")
    target = target_dims(server_args.model_path)
    draft_json = read_model_config(path, "--speculative-draft-model-path")
    try:
        draft = read_draft_config(path, target)
    except DraftCheckpointError as e:
        raise ServerArgsError(f"--speculative-draft-model-path {path!r} does not fit the target: {e}") from e
    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = draft.block_size
    block = server_args.speculative_num_draft_tokens
    if getattr(server_args, "speculative_adaptive", False) and isinstance(block, int) and block > draft.block_size:
        # Adaptive: the flag is an upper bound on a verify block; a block drafts in one forward,
        # so no verify block can be longer than the drafter's.
        logger.warning("--speculative-num-draft-tokens %d: the drafter drafts blocks of %d; adaptive mode "
                       "verifies at most %d drafts per step", block, draft.block_size, draft.block_size - 1)
        server_args.speculative_num_draft_tokens = block = draft.block_size
    if isinstance(block, bool) or not isinstance(block, int) or not 2 <= block <= draft.block_size:
        raise ServerArgsError(
            f"--speculative-num-draft-tokens must be an integer in [2, {draft.block_size}] (the "
            f"drafter's block_size), got {block!r}"
        )
    server_args.speculative_token_map = default_token_map(server_args.speculative_token_map, path, draft_json)
    token_map = token_map_file(server_args.speculative_token_map)
    if token_map is not None:
        read_token_map(token_map, draft.vocab_size)


NO_TOKEN_MAP = "none"


def default_token_map(flag: str | None, draft_dir: str, draft_json: dict) -> str | None:
    """--speculative-token-map as given; when not given, the map the drafter's config.json names
    (`"token_map": {"file": ...}`, beside its weights), like an EAGLE-3 checkpoint's reduced draft
    vocabulary. `none` keeps the whole vocabulary (`token_map_file`).

    Why a default: the drafter's lm_head over the whole vocabulary is most of a small drafter's
    step on a CPU (propose 22.7 vs 12.0 ms with the shipped 8,192-id map, docs/performance.md
    section 14), and a user who did not know the flag paid that on every step."""
    if flag is not None:
        return flag
    declared = draft_json.get("token_map")
    name = declared.get("file") if isinstance(declared, dict) else None
    if not name:
        return None
    shipped = os.path.join(draft_dir, name)
    if not os.path.isfile(shipped):
        raise ServerArgsError(
            f"--speculative-draft-model-path {draft_dir!r}: its config.json names the token map {name!r}, "
            f"which is not there (pass --speculative-token-map FILE, or 'none' for the whole vocabulary)"
        )
    logger.info("drafting over the drafter's hot-token map %s (--speculative-token-map none: whole vocabulary)",
                shipped)
    return shipped


def token_map_file(flag: str | None) -> str | None:
    """The map file to read, or None (no flag, or `none`)."""
    return None if flag is None or str(flag).strip().lower() == NO_TOKEN_MAP else flag


def read_token_map(path: str, vocab_size: int) -> list[int]:
    """The token ids of a --speculative-token-map file (a JSON list), checked against the vocabulary."""
    flag = "--speculative-token-map"
    if not os.path.isfile(path):
        raise ServerArgsError(f"{flag} {path!r}: no such file")
    try:
        with open(path) as f:
            ids = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServerArgsError(f"{flag} {path!r}: not a JSON list of token ids ({e})") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ServerArgsError(f"{flag} {path!r}: expected a non-empty JSON list of integer token ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad or len(set(ids)) != len(ids):
        raise ServerArgsError(
            f"{flag} {path!r}: token ids must be distinct and in [0, {vocab_size})"
            + (f"; got {bad[:5]}" if bad else "; got duplicates")
        )
    return ids


class DFlashWorker:
    def __init__(self, server_args: Any):
        from torchax_proposer import DFlashProposer, read_draft_config

        target_config = target_dims(server_args.model_path)
        draft_config = read_draft_config(server_args.speculative_draft_model_path, target_config)
        token_map_path = token_map_file(server_args.speculative_token_map)
        self.block_size = server_args.speculative_num_draft_tokens or draft_config.block_size
        self.tokens_per_step = self.block_size  # a verify block writes B KV slots
        self.target_worker = TargetWorker(
            server_args, aux_layer_ids=draft_config.target_layer_ids, tokens_per_step=self.block_size
        )
        self.runner = self.target_worker.runner
        self.allocator = self.target_worker.allocator
        self.vocab_size = self.target_worker.vocab_size
        token_map = None if token_map_path is None else read_token_map(token_map_path, draft_config.vocab_size)
        # The target's CPU kernels serve the drafter too; its bf16 weights on AMX tiles where there are.
        tiles = self.runner.cpu_matmul and cpu_kernels.amx_products()
        self.proposer = DFlashProposer(
            server_args.speculative_draft_model_path,
            target_embed=self.runner.embed,
            target_lm_head=self.runner.lm_head,
            target_config=target_config,
            max_num_seqs=server_args.max_running_requests,
            max_context_len=server_args.context_length + self.block_size,
            block_size=self.block_size,
            dtype=server_args.resolved_dtype,
            token_map=token_map,
            few_row_matmul=functools.partial(cpu_kernels.rows_matmul, bf16_tiled=tiles) if self.runner.cpu_matmul else None,
            kernel_lm_head=self.runner.params.get("blocks", {}).get("lm_head"),  # its GGUF blocks, if any
            cpu_attention=cpu_kernels.dense_attention if self.runner.cpu_attention else None,  # the target's setting
            cache_attention=cpu_kernels.cache_attention if self.runner.cpu_attention else None,  # the cache in place
            greedy_head=greedy_head.for_drafter(self.runner.params, token_map),  # greedy drafts: the target's, if it has one
            narrow_layout=cpu_kernels.bf16_tile_order if tiles else None,
        )
        self.drafting: set[int] = set()  # slots with drafter state
        self.timings: dict[str, float] = defaultdict(float)  # seconds per phase, for benchmarks

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        if batch.forward_mode is ForwardMode.EXTEND:
            return self.forward_extend(batch)
        return self.forward_decode(batch)

    def forward_extend(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        """Target prefill (first token = the first bonus) and the drafter's context features."""
        result, out = self.target_worker.forward_extend(batch)
        for slot, features in zip(batch.slots, out.features):
            self.add_context(slot, features)
        result.num_draft_tokens = self.block_size - 1
        return result

    def add_context(self, slot: Any, features: Any) -> None:
        """The drafter's context for a prefilled sequence: the aux features [L, n_aux*H] of all
        its committed tokens (a front door that prefills in chunks collects them first)."""
        self._release_drafter(slot)  # only set when a failed batch is being retried
        self.proposer.add(slot, features)
        self.drafting.add(slot)

    def forward_decode(self, batch: ModelWorkerBatch) -> GenerationBatchResult:
        B, n = self.block_size, len(batch.slots)
        slots = batch.slots
        bonus = [ids[0] for ids in batch.input_ids]  # each request's pending token
        greedy = batch.sampling_info.is_all_greedy
        t0 = time.perf_counter()

        # 1. Draft: B-1 tokens per request from one drafter forward over all blocks.
        if greedy:
            drafts = self.proposer.propose(slots, bonus)
        elif self.proposer.config.is_dflash2:  # the selector samples its path and returns q over K
            from torchax_proposer import dense_draft_probs

            path = self.proposer.propose_path(slots, bonus, temperatures=batch.sampling_info.temperatures,
                                              key=self.target_worker.next_key())
            drafts = path.tokens
            draft_probs = dense_draft_probs(path.candidates, path.probs, self.vocab_size, rows=bucket(n))
        else:
            drafts, draft_logits = self.proposer.propose(slots, bonus, return_logits=True)
            draft_probs, drafts = self._sample_drafts(np.asarray(draft_logits), batch.sampling_info)
        drafts = np.asarray(drafts, np.int32)
        t1 = time.perf_counter()

        # 2.-3. Verify and accept in one jitted target step over every [bonus, drafts...] block at
        # positions L..: only the accept counts a[i] and the new bonus tokens come to the host.
        # Sampling: rejection sampling against q; greedy rows ride along exactly (one-hot p and q
        # make rejection sampling the greedy prefix match).
        seqs = [SeqInput([bonus[i], *drafts[i]], batch.prefix_lens[i], batch.page_tables[i], "all") for i in range(n)]
        if greedy:
            out = self.runner.verify(seqs)
        else:
            info = batch.sampling_info
            out = self.runner.verify(seqs, info.temperatures, info.top_ps, info.top_ks, draft_probs=draft_probs,
                                     key=self.target_worker.next_key())
        accepted, new_bonus = out.accepted, out.bonus
        t2 = time.perf_counter()

        # 4. Commit: the drafter gets the features of exactly the a+1 committed rows (the old bonus
        # and the accepted drafts), straight from the device. Row i's new tokens: its a accepted
        # drafts, then the bonus.
        self.proposer.commit_block(slots, accepted, out.features)
        tokens = np.concatenate([drafts, np.zeros((n, 1), np.int32)], axis=1)
        tokens[np.arange(n), accepted] = new_bonus
        t3 = time.perf_counter()
        for phase, seconds in (("draft", t1 - t0), ("verify", t2 - t1), ("commit", t3 - t2)):
            self.timings[phase] += seconds
        self.timings["steps"] += 1
        return GenerationBatchResult(tokens, accepted.astype(np.int32) + 1, accept_lens=accepted,
                                     num_draft_tokens=B - 1)

    def _sample_drafts(self, draft_logits: np.ndarray, sampling_info: SamplingBatchInfo) -> tuple[jax.Array, np.ndarray]:
        """Draft tokens ~ q, with q the same transform of the draft logits as the target's p.

        Returns q [rows, B-1, V] (bucketed rows) and the drafts [n, B-1]."""
        q, sampled, _, _ = self._draw_drafts(draft_logits, sampling_info)
        return q, sampled

    def _draw_drafts(self, draft_logits: np.ndarray, sampling_info: SamplingBatchInfo):
        """(q [rows, B-1, V], drafts [n, B-1], and the padded logits [rows*(B-1), V] and
        temperatures they were drawn with)."""
        n, gamma, vocab = draft_logits.shape
        rows = bucket(n)
        padded = np.zeros((rows * gamma, vocab), np.float32)
        padded[: n * gamma] = draft_logits.reshape(n * gamma, vocab)
        temperature, top_p, top_k = sampling_info.padded(rows * gamma, repeat=gamma)
        q = sampling.probs(padded, temperature, top_p, top_k)
        sampled = np.asarray(_draw(q, self.target_worker.next_key())).reshape(rows, gamma)[:n]
        return q.reshape(rows, gamma, vocab), sampled, padded, temperature

    def release(self, slot: int) -> None:
        self.target_worker.release(slot)
        self._release_drafter(slot)

    def _release_drafter(self, slot: int) -> None:
        if slot in self.drafting:
            self.proposer.release(slot)
            self.drafting.discard(slot)

    def score(self, token_ids: list[int], top_k: int) -> TokenScores | None:
        return self.target_worker.score(token_ids, top_k)

    def committed_len(self, slot: int) -> int:
        """The drafter's committed length of a sequence (equals the target's: invariant checks)."""
        return self.proposer.committed_len(slot)

    def num_compilations(self) -> int:
        return self.target_worker.num_compilations() + self.proposer.num_compilations()


@jax.jit
def _draw(probs: jax.Array, key: jax.Array) -> jax.Array:
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
