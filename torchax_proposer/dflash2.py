"""DFlash 2 (z-lab, `DFlash2DraftModel`): the DFlash drafter plus two pieces, in plain torch ops.

1. Each layer wraps attention and MLP in a grouped dynamic causal convolution
   (`GroupedDynamicCausalConv`): output[t] = sum over taps j of (base[j] + dynamic[t, j]) * x[t - j],
   with `base` one weight per channel and `dynamic` one weight per channel group, projected from
   the sublayer's input at t. Taps never reach across the start of a draft block (zeros there).
2. A `CandidateSelector` replaces the per-position argmax: it keeps the top-K tokens of each draft
   position's logits and scores each candidate c after predecessor p as
       score(c) = logit(c) + < predecessor_codebook[p] * hidden_projection(h), successor_codebook[c] >
   then walks a path from the anchor (the bonus token): greedy takes the argmax at each position;
   at temperature T > 0 it samples from q = softmax(score / T) over the K candidates, and q is
   returned so that verification can stay lossless (rejection sampling with the candidates' q).

Parameter names are z-lab's: `layers.N.{attention_conv,mlp_conv}.{base_kernel,
kernel_projection.weight}`, `candidate_selector.{hidden_projection.weight, predecessor_codebook,
successor_codebook}` (the codebooks are bare parameters, as stored in z-lab checkpoints).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .config import DFlashConfig
from .model import DFlashDraftModel


class GroupedDynamicCausalConv(nn.Module):
    """Two convolutions around one sublayer: side 0 on its input, side 1 on its output."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        hidden = config.hidden_size
        self.kernel_size = config.conv_kernel_size
        self.group_size = config.conv_group_size
        self.num_groups = hidden // self.group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * self.kernel_size * self.num_groups, bias=False)
        # A fresh convolution is the identity (tap 0 = 1, no dynamic part), so a new DFlash 2
        # drafter starts as the DFlash 1 drafter it extends. Checkpoints overwrite both.
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(convolved sublayer input, the output side's dynamic kernel), both from x [n, L, H]."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        return self._convolve(x, dynamic[..., 0, :, :], 0, block_len), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor, block_len: int | None = None) -> torch.Tensor:
        """The sublayer output y [n, L, H] convolved with the kernel `prepare` returned."""
        return self._convolve(y, dynamic, 1, block_len)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, side: int, block_len: int | None) -> torch.Tensor:
        n, length, hidden = x.shape
        block = length if block_len is None else block_len
        # [n, blocks, block, groups, group_size]: taps shift along the block axis only.
        blocks = x.reshape(n, length // block, block, self.num_groups, self.group_size)
        dynamic = dynamic.reshape(n, length // block, block, self.kernel_size, self.num_groups, 1)
        base = self.base_kernel[side].to(x.dtype).view(self.kernel_size, self.num_groups, self.group_size)
        out = torch.zeros_like(blocks)
        for tap in range(min(self.kernel_size, block)):  # taps past the block read only zeros
            shifted = blocks if tap == 0 else F.pad(blocks[:, :, :-tap], (0, 0, 0, 0, tap, 0))
            # The reference's order of additions (base term, then dynamic term), for equal rounding.
            out = out + base[tap] * shifted
            out = out + dynamic[:, :, :, tap] * shifted
        return out.reshape(n, length, hidden)


class CandidateSelector(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        rank, vocab = config.selector_rank, config.vocab_size
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        # Fresh selectors add nothing to the logits (successors zero), as in SpecForge: the path
        # is then the per-position argmax until training moves the successor codebook first.
        with torch.no_grad():
            self.predecessor_codebook.normal_(std=0.02)
            self.successor_codebook.zero_()

    def candidates(
        self, logits: torch.Tensor, token_map: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary scores, candidate token ids), each [..., K]: the top-K of logits [..., V'],
        best first. With a hot-token map, logits are over the map's ids and are mapped back."""
        unary, index = torch.topk(logits, self.top_k, dim=-1)
        return unary, (index if token_map is None else token_map[index])

    def scores(
        self, projected: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor
    ) -> torch.Tensor:
        """Scores [..., K] of candidates [..., K] after predecessors [...]; projected [..., R] is
        hidden_projection of the drafter's hidden state at the candidates' position."""
        context = F.embedding(predecessors, self.predecessor_codebook) * projected
        successors = F.embedding(candidates, self.successor_codebook)
        return unary + torch.einsum("...r,...kr->...k", context, successors)

    def forward(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        *,
        temperature: torch.Tensor | None = None,
        gumbel: torch.Tensor | None = None,
        token_map: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The draft path through the candidates of P positions.

        hidden [n, P, H], logits [n, P, V'] (V' = len(token_map) with a map), anchor_ids [n].
        temperature None: greedy, returns (path [n, P], candidates [n, P, K], None).
        temperature [n] (0 = greedy row) with gumbel [n, P, K] standard Gumbel noise: samples
        each step from q = softmax(score / T) (Gumbel-max), returns (path, candidates, q [n, P, K]
        float32; one-hot on the path for greedy rows).
        The loop over positions is static (P is a shape), so it lowers to a fixed program.
        """
        unary, candidates = self.candidates(logits, token_map)
        projected = self.hidden_projection(hidden)
        arange_k = torch.arange(self.top_k, device=hidden.device)
        predecessors = anchor_ids
        path, probs = [], []
        for position in range(hidden.shape[1]):
            scores = self.scores(projected[:, position], predecessors, candidates[:, position], unary[:, position])
            scores = scores.float()
            best = scores.argmax(-1)
            if temperature is None:
                index = best
            else:
                greedy = temperature <= 0
                scaled = scores / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None].float()
                index = torch.where(greedy, best, (scaled + gumbel[:, position].float()).argmax(-1))
                one_hot = (arange_k == index[:, None]).float()
                probs.append(torch.where(greedy[:, None], one_hot, scaled.softmax(-1)))
            predecessors = candidates[:, position].gather(-1, index[:, None])[:, 0]
            path.append(predecessors)
        return torch.stack(path, 1), candidates, (torch.stack(probs, 1) if probs else None)


class DFlash2DraftModel(DFlashDraftModel):
    """`DFlashDraftModel` with convolutions in every layer and a candidate selector."""

    def __init__(self, config: DFlashConfig):
        if not config.is_dflash2:
            raise ValueError(f"DFlash2DraftModel needs a DFlash 2 config, got architecture {config.architecture!r}")
        super().__init__(config)
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(config)
            layer.mlp_conv = GroupedDynamicCausalConv(config)
        self.candidate_selector = CandidateSelector(config)

    @property
    def top_k(self) -> int:
        return self.candidate_selector.top_k

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        target_lm_head: torch.Tensor,
        *,
        temperature: torch.Tensor | None = None,
        gumbel: torch.Tensor | None = None,
        token_map: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Draft path of hidden [n, B-1, H] (the block's rows 1..B-1) from anchor_ids [n] (the
        bonus tokens); see `CandidateSelector.forward`. With `token_map`, target_lm_head holds only
        the map's rows, and candidates come from the mapped vocabulary."""
        logits = self.compute_logits(hidden, target_lm_head)
        return self.candidate_selector(
            hidden, logits, anchor_ids, temperature=temperature, gumbel=gumbel, token_map=token_map
        )


def build_draft_model(config: DFlashConfig) -> DFlashDraftModel:
    """The drafter module the config names (DFlash 1 or DFlash 2)."""
    return DFlash2DraftModel(config) if config.is_dflash2 else DFlashDraftModel(config)
