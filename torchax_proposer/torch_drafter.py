"""`TorchDrafter`: the same proposer protocol in plain eager PyTorch, for PyTorch users.

One sequence at a time, each with a growing context K/V cache (a torch tensor per layer), on
whatever device the model lives on. Same semantics as `DFlashProposer`: the cache plus the
pending rows always cover exactly the committed length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

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
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already added")
        self._seqs[seq_id] = _TorchSeq(kv=None, cache_len=0, pending=self._features(context_features))

    def release(self, seq_id: Any) -> None:
        del self._seqs[seq_id]

    def committed_len(self, seq_id: Any) -> int:
        return self._seqs[seq_id].committed_len

    def context_kv(self, seq_id: Any) -> list[KV] | None:
        """The cached context K/V of a sequence (positions 0 .. cache_len-1)."""
        return self._seqs[seq_id].kv

    @torch.inference_mode()
    def draft(self, seq_id: Any, bonus_token: int) -> torch.Tensor:
        """Runs the block [bonus, MASK x (B-1)] at positions L .. L+B-1; returns its hidden states
        [B, H] (row k >= 1 predicts the token at position L+k) and appends the pending context."""
        seq = self._seqs[seq_id]
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
        """Greedy drafts [n, B-1] (and float32 logits [n, B-1, V] when asked)."""
        hidden = torch.stack([self.draft(s, b) for s, b in zip(seq_ids, bonus_tokens, strict=True)])
        logits = self.model.compute_logits(hidden[:, 1:], self.lm_head).float()
        tokens = logits.argmax(-1).to(torch.int32)
        return (tokens, logits) if return_logits else tokens

    def commit(self, seq_ids: Sequence[Any], accepted_counts: Sequence[int], aux_features: Sequence[torch.Tensor]) -> None:
        for seq_id, count, rows in zip(seq_ids, accepted_counts, aux_features, strict=True):
            if not 0 <= int(count) <= self.block_size - 1 or len(rows) != int(count) + 1:
                raise ValueError(f"sequence {seq_id!r}: accepted {count} with {len(rows)} feature rows")
            seq = self._seqs[seq_id]
            seq.pending = torch.cat([seq.pending, self._features(rows)])

    def _features(self, rows: torch.Tensor) -> torch.Tensor:
        rows = torch.as_tensor(rows).to(self.device, self.dtype)
        width = self.model.config.num_context_features
        if rows.ndim != 2 or rows.shape[1] != width:
            raise ValueError(f"context features must be [rows, {width}], got {tuple(rows.shape)}")
        return rows
