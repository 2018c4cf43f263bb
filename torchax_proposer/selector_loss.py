"""The training objective of DFlash 2's candidate selector, for the drafter trainer to add.

The selector re-ranks the top-K candidates of each draft position. It is trained teacher-forced:
position k of a block gets the GOLD token of position k-1 as predecessor (the anchor for k = 1),
and a K-way cross-entropy asks it to pick the gold token of position k among the candidates. When
the gold token is not among the top-K it replaces the weakest candidate, so every supervised
position has a label (vllm-project/speculators does the same; SpecForge-style trainers may instead
drop those positions). Position weights are the drafter loss's (decay x mask), and the selector
term is scaled by alpha:

    loss = dflash_loss + selector_loss(...)            selector_loss = alpha * weighted mean CE

"Gold" is whatever the unary loss supervises with (the target-regenerated data token, or the
target's argmax). The unary logits must be the drafter's own (`compute_logits` through the
target's lm_head), since serving takes the candidates from them. Gradients flow into the selector
and, through the unary scores and the hidden states, into the backbone; pass detached
`hidden` / `unary_logits` to train the selector alone.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .dflash2 import CandidateSelector


def teacher_forced_predecessors(anchor_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Predecessors of the block positions 1..B-1: anchor_ids [...] and the gold labels [..., B-1]
    of those positions -> [anchor, label_1, ..., label_{B-2}]."""
    return torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)


def training_candidates(
    unary_logits: torch.Tensor, gold_ids: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-K candidates of unary_logits [..., V] (best first) with the gold [...] inserted in
    place of the K-th when missing. Returns (candidate ids [..., K], their unary scores [..., K],
    the gold's index [...], whether the gold was in the top-K [...])."""
    top_ids = torch.topk(unary_logits, top_k, dim=-1).indices
    hits = top_ids == gold_ids[..., None]
    in_top_k = hits.any(-1)
    candidates = top_ids.clone()
    candidates[..., -1] = torch.where(in_top_k, top_ids[..., -1], gold_ids)
    gold_index = torch.where(in_top_k, hits.int().argmax(-1), torch.full_like(gold_ids, top_k - 1))
    # Gathered again (not topk's values): an inserted gold keeps its own unary score.
    return candidates, unary_logits.gather(-1, candidates), gold_index, in_top_k


def selector_loss(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    unary_logits: torch.Tensor,
    predecessor_ids: torch.Tensor,
    gold_ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    alpha: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """alpha x the weighted mean of the selector's K-way cross-entropy over supervised positions.

    hidden [..., H]: the drafter's final-normed hidden states at the draft positions;
    unary_logits [..., V]: its logits there; predecessor_ids, gold_ids, weights [...]
    (see `teacher_forced_predecessors`; weight 0 = not supervised).
    Returns (loss, stats): stats["selector_loss"] is the CE before alpha; "recall" is the weighted
    share of positions whose gold was in the top-K; "accuracy" / "unary_accuracy" the weighted
    share where the selector's / the plain logits' best candidate is the gold.
    """
    candidates, unary, gold_index, in_top_k = training_candidates(unary_logits, gold_ids, selector.top_k)
    scores = selector.scores(selector.hidden_projection(hidden), predecessor_ids, candidates, unary).float()
    ce = F.cross_entropy(scores.flatten(0, -2), gold_index.flatten(), reduction="none").view_as(weights)
    weights = weights.float()
    total = weights.sum().clamp_min(1e-6)
    mean_ce = (ce * weights).sum() / total
    with torch.no_grad():
        share = lambda hit: float((hit.float() * weights).sum() / total)  # noqa: E731
        stats = {
            "selector_loss": float(mean_ce),
            "recall": share(in_top_k),
            "accuracy": share(scores.argmax(-1) == gold_index),
            "unary_accuracy": share(unary.argmax(-1) == gold_index),
        }
    return alpha * mean_ce, stats
