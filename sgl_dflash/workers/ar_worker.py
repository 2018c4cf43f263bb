"""The NONE worker: plain autoregressive decoding of the JAX target.

The scheduler calls `prefill(reqs, append)` for newly admitted requests and `decode(reqs, append)`
for one step of every running request; both run ONE packed ragged `TargetRunner.forward`.
`append(req, tokens)` hands new tokens to the scheduler, which applies the stop rules.
A request's `slot` is its sequence id in the page allocator; the scheduler allocates its pages.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jax_backend import SeqInput, TargetRunner, sampling
from jax_backend.batch import bucket
from sgl_dflash.schedule_batch import Req
from sgl_dflash.server_args import ServerArgs

AppendFn = Callable[[Req, list[int]], int]

# Sampling and acceptance inside the target's jitted step (TargetRunner.sample / .verify): only
# token ids and accept counts come to the host. SGL_DFLASH_DEVICE_STEPS=0 keeps the host path
# (logits to the host), for A/B measurements.
DEVICE_STEPS = os.environ.get("SGL_DFLASH_DEVICE_STEPS", "1") != "0"


class ARWorker:
    tokens_per_step = 1  # KV slots one decode step writes past the committed length

    def __init__(self, server_args: ServerArgs, aux_layer_ids: Sequence[int] = ()):
        self.server_args = server_args
        # Recording aux rows for the caller (training data) is a NONE feature (ServerArgs.check).
        self.record_aux = bool(server_args.aux_hidden_layers)
        if self.record_aux:
            aux_layer_ids = server_args.aux_hidden_layers
        self.target = TargetRunner(
            server_args.model_path,
            dtype=server_args.resolved_dtype,
            page_size=server_args.page_size,
            max_total_tokens=server_args.max_total_tokens,
            max_num_seqs=server_args.max_running_requests,
            max_model_len=server_args.context_length + self.tokens_per_step,
            aux_layer_ids=aux_layer_ids,
        )
        self.allocator = self.target.allocator
        self.vocab_size = self.target.config.vocab_size
        self._key = jax.random.PRNGKey(server_args.random_seed)

    def prefill(self, reqs: list[Req], append: AppendFn):
        """Compute the KV of each request's committed tokens; sample a first token for new ones.

        A retracted request (it already has output) is recomputed up to its pending last token,
        which stays pending: nothing is sampled for it.
        """
        seqs = [SeqInput(prefill_token_ids(r), 0, self.page_table(r), "last") for r in reqs]
        out = self.target.forward(seqs)
        if self.record_aux:  # a retracted request's rows are recomputed: replace, not append
            for r, aux in zip(reqs, out.aux_hidden):
                r.aux_hidden = [np.asarray(self.target.hidden_state_features(aux))]
        fresh = [i for i, r in enumerate(reqs) if not r.output_ids]
        if fresh:
            logits = np.concatenate([out.logits[i] for i in fresh])
            tokens = self.sample(logits, [reqs[i] for i in fresh])
            for i, token in zip(fresh, tokens):
                append(reqs[i], [int(token)])
        return out

    def decode(self, reqs: list[Req], append: AppendFn) -> None:
        """One token for every request: its pending token runs at position committed_len."""
        seqs = [SeqInput([r.last_token], r.committed_len, self.page_table(r), "last") for r in reqs]
        if DEVICE_STEPS:
            out = self.target.sample(seqs, *sampling_arrays(reqs, len(reqs)), self.next_key())
            tokens = out.tokens
        else:
            out = self.target.forward(seqs)
            tokens = self.sample(np.concatenate(out.logits), reqs)
        if self.record_aux:
            for r, aux in zip(reqs, out.aux_hidden):
                r.aux_hidden.append(np.asarray(self.target.hidden_state_features(aux)))
        for r, token in zip(reqs, tokens):
            append(r, [int(token)])

    def release(self, slot: int) -> None:
        self.allocator.free(slot)

    def num_compilations(self) -> int:
        return self.target.num_compilations()

    # -- helpers --------------------------------------------------------------------------
    def page_table(self, req: Req) -> list[int]:
        return self.allocator.page_table(req.slot)

    def next_key(self) -> jax.Array:
        self._key, key = jax.random.split(self._key)
        return key

    def sample(self, logits: np.ndarray, reqs: list[Req]) -> np.ndarray:
        """One token per row of `logits` [n, V] with each request's sampling parameters."""
        n = len(reqs)
        rows = bucket(n)  # few distinct shapes: no recompiling as the batch changes
        padded = np.zeros((rows, logits.shape[-1]), np.float32)
        padded[:n] = logits
        temperature, top_p, top_k = sampling_arrays(reqs, rows)
        tokens = sampling.sample(padded, temperature, top_p, top_k, self.next_key())
        return np.asarray(tokens)[:n]


def prefill_token_ids(req: Req) -> list[int]:
    """Tokens whose K/V a prefill computes: everything but a pending last output token."""
    return req.input_ids + req.output_ids[:-1]


def sampling_arrays(reqs: list[Req], rows: int, repeat: int = 1) -> tuple[np.ndarray, ...]:
    """Per-row temperature / top_p / top_k, each request repeated `repeat` times, padded
    (greedy) to `rows` rows."""
    temperature = np.zeros(rows, np.float32)
    top_p = np.ones(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        span = slice(i * repeat, (i + 1) * repeat)
        temperature[span] = 0.0 if sp.is_greedy else sp.temperature
        top_p[span] = sp.top_p
        top_k[span] = max(sp.top_k, 0)
    return temperature, top_p, top_k
