"""`TorchDrafter`: the same proposer protocol in plain eager PyTorch, for PyTorch users.

One sequence at a time, each with a growing context K/V cache (a torch tensor per layer), on
whatever device the model lives on. Same semantics as `DFlashProposer`: the cache plus the
pending rows always cover exactly the committed length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .config import DrafterStateError
from .model import KV, DFlashDraftModel


@dataclass
class _TorchSeq:
    kv: list[KV] | None  # per layer (K, V) [1, cache_len, kv_heads, head_dim]
    cache_len: int
    pending: torch.Tensor  # [rows, n_aux*H] target features not yet in the cache

    @property
    def committed_len(self) -> int:
        return self.cache_len + len(self.pending)


class TorchDrafter:
    def __init__(
        self,
        model: DFlashDraftModel,
        target_embed: torch.Tensor,
        target_lm_head: torch.Tensor,
        *,
        block_size: int | None = None,
    ):
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.embed = target_embed.to(self.device, self.dtype)
        self.lm_head = target_lm_head.to(self.device, self.dtype)
        self.block_size = int(model.block_size if block_size is None else block_size)
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        self.mask_token_id = model.mask_token_id
        self.target_layer_ids = model.target_layer_ids
        self._seqs: dict[Any, _TorchSeq] = {}

    def add(self, seq_id: Any, context_features: torch.Tensor) -> None:
        """Registers a sequence after prefill; context_features [L, n_aux*H], L >= 1."""
        if seq_id in self._seqs:
            raise DrafterStateError(f"sequence {seq_id!r} is already added")
        features = self._features(seq_id, context_features)
        if len(features) == 0:
            raise DrafterStateError(f"sequence {seq_id!r}: got 0 feature rows, expected >= 1")
        self._seqs[seq_id] = _TorchSeq(kv=None, cache_len=0, pending=features)

    def release(self, seq_id: Any) -> None:
        self._state(seq_id)
        del self._seqs[seq_id]

    def committed_len(self, seq_id: Any) -> int:
        return self._state(seq_id).committed_len

    def context_kv(self, seq_id: Any) -> list[KV] | None:
        """The cached context K/V of a sequence (positions 0 .. cache_len-1)."""
        return self._state(seq_id).kv

    @torch.inference_mode()
    def draft(self, seq_id: Any, bonus_token: int) -> torch.Tensor:
        """Runs the block [bonus, MASK x (B-1)] at positions L .. L+B-1; returns its hidden states
        [B, H] (row k >= 1 predicts the token at position L+k) and appends the pending context."""
        seq = self._state(seq_id)
        length = seq.committed_len
        arange = lambda a, b: torch.arange(a, b, device=self.device)[None]  # noqa: E731
        block_ids = torch.full((1, self.block_size), self.mask_token_id, device=self.device)
        block_ids[0, 0] = int(bonus_token)
        hidden, new_kv = self.model(
            seq.pending[None],
            arange(seq.cache_len, length),
            noise_embedding=self.model.embed_block(block_ids, self.embed),
            block_positions=arange(length, length + self.block_size),
            past_kv=seq.kv,
        )
        if seq.kv is None:
            seq.kv = new_kv
        else:
            seq.kv = [(torch.cat([k, nk], 1), torch.cat([v, nv], 1)) for (k, v), (nk, nv) in zip(seq.kv, new_kv)]
        seq.cache_len, seq.pending = length, seq.pending[:0]
        return hidden[0]

    @torch.inference_mode()
    def propose(
        self, seq_ids: Sequence[Any], bonus_tokens: Sequence[int], *, return_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts [n, B-1] (and float32 logits [n, B-1, V] when asked). DFlash 2: the
        selector's greedy path (no logits: sample with `propose_path`)."""
        if self.model.config.is_dflash2:
            if return_logits:
                raise ValueError("a DFlash 2 drafter samples its own path: use propose_path(..., temperatures=)")
            return self.propose_path(seq_ids, bonus_tokens)[0]
        hidden = self._block_hidden(seq_ids, bonus_tokens)
        logits = self.model.compute_logits(hidden[:, 1:], self.lm_head).float()
        tokens = logits.argmax(-1).to(torch.int32)
        return (tokens, logits) if return_logits else tokens

    @torch.inference_mode()
    def propose_path(
        self,
        seq_ids: Sequence[Any],
        bonus_tokens: Sequence[int],
        *,
        temperatures: Sequence[float] | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """DFlash 2: (path [n, B-1], candidates [n, B-1, K], q [n, B-1, K] or None), as
        `DFlashProposer.propose_path` (greedy when temperatures is None)."""
        if not self.model.config.is_dflash2:
            raise ValueError("propose_path needs a DFlash 2 drafter")
        hidden = self._block_hidden(seq_ids, bonus_tokens)[:, 1:]
        gumbel = temperature = None
        if temperatures is not None:
            temperature = torch.as_tensor(temperatures, dtype=torch.float32, device=self.device)
            shape = (*hidden.shape[:2], self.model.top_k)
            # Standard Gumbel noise: -log(E) with E ~ Exp(1).
            gumbel = -torch.empty(shape, device=self.device).exponential_(generator=generator).log()
        anchors = torch.as_tensor([int(b) for b in bonus_tokens], device=self.device, dtype=torch.long)
        path, candidates, probs = self.model.propose(
            hidden, anchors, self.lm_head, temperature=temperature, gumbel=gumbel
        )
        return path.to(torch.int32), candidates.to(torch.int32), probs

    def _block_hidden(self, seq_ids: Sequence[Any], bonus_tokens: Sequence[int]) -> torch.Tensor:
        """`draft` of every sequence, stacked: [n, B, H]."""
        if len(bonus_tokens) != len(seq_ids):
            raise DrafterStateError(f"{len(bonus_tokens)} bonus tokens for {len(seq_ids)} sequences")
        if not len(seq_ids):
            return torch.zeros(0, self.block_size, self.model.config.hidden_size, device=self.device, dtype=self.dtype)
        return torch.stack([self.draft(s, int(b)) for s, b in zip(seq_ids, bonus_tokens)])

    def commit(self, seq_ids: Sequence[Any], accepted_counts: Sequence[int], aux_features: Sequence[torch.Tensor]) -> None:
        """aux_features[i] [a_i+1, n_aux*H]: target features of the block's first a_i+1 tokens."""
        if not len(seq_ids) == len(accepted_counts) == len(aux_features):
            raise DrafterStateError(
                f"commit got {len(seq_ids)} ids, {len(accepted_counts)} accepted counts, {len(aux_features)} feature arrays"
            )
        checked = []
        for seq_id, count, rows in zip(seq_ids, accepted_counts, aux_features):
            seq, rows = self._state(seq_id), self._features(seq_id, rows)
            if not 0 <= int(count) <= self.block_size - 1:
                raise DrafterStateError(f"sequence {seq_id!r}: accepted count {count} outside [0, {self.block_size - 1}]")
            if len(rows) != int(count) + 1:
                raise DrafterStateError(f"sequence {seq_id!r}: got {len(rows)} feature rows, expected {int(count) + 1}")
            checked.append((seq, rows))
        for seq, rows in checked:  # all or nothing
            seq.pending = torch.cat([seq.pending, rows])

    def _state(self, seq_id: Any) -> _TorchSeq:
        if seq_id not in self._seqs:
            raise DrafterStateError(f"unknown sequence {seq_id!r} (not added, or released)")
        return self._seqs[seq_id]

    def _features(self, seq_id: Any, rows: Any) -> torch.Tensor:
        rows = torch.as_tensor(rows).to(self.device, self.dtype)
        width = self.model.config.num_context_features
        if rows.ndim != 2 or rows.shape[1] != width:
            raise DrafterStateError(
                f"sequence {seq_id!r}: context features have shape {tuple(rows.shape)}, expected [rows, {width}]"
            )
        return rows
