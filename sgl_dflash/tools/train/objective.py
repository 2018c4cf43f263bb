"""What the drafter learns and how it is measured: the frozen target's features and greedy labels,
the drafter's block outputs, the decay-weighted loss (+ DFlash 2's selector loss), and held-out
teacher-forced acceptance."""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from sgl_dflash.tools.train import core
from sgl_dflash.tools.train.batches import Blocks, TrainSequence, device_batch, make_blocks


class FeatureTarget:
    """The frozen target on `device`: `(features [b, S, n*H], greedy next ids [b, S])` per batch."""

    def __init__(self, target_dir: str | os.PathLike, layer_ids: Sequence[int], device: torch.device):
        self.model = core.load_frozen_target(target_dir).to(device)
        self.layer_ids = list(layer_ids)
        self.device = device
        embed, head = core.target_embed_and_head(self.model)
        self.embed, self.lm_head = embed, head

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
        # Right padding needs no attention mask: causal attention never lets a real token see a pad.
        out = self.model.model(input_ids=tokens, output_hidden_states=True, use_cache=False)
        features = torch.cat([out.hidden_states[l + 1] for l in self.layer_ids], dim=-1)
        last = out.last_hidden_state.flatten(0, 1)
        next_ids = torch.cat([(last[i : i + chunk] @ self.lm_head.T).argmax(-1) for i in range(0, len(last), chunk)])
        return features, next_ids.view(tokens.shape)


def draft_hidden(model: torch.nn.Module, embed: torch.Tensor, blocks: Blocks, block_size: int) -> torch.Tensor:
    """Drafter outputs `[b, nb, B, H]` for every block; each block sees its own context prefix."""
    b, nb = blocks.anchors.shape
    width = blocks.tokens.shape[1]
    device = blocks.tokens.device
    block_ids = torch.full((b, nb, block_size), model.mask_token_id, dtype=torch.int64, device=device)
    block_ids[:, :, 0] = torch.gather(blocks.tokens, 1, blocks.anchors)
    noise = model.embed_block(block_ids.view(b, nb * block_size), embed)
    block_pos = (blocks.anchors[:, :, None] + torch.arange(block_size, device=device)).view(b, nb * block_size)
    hidden, _ = model(context_features=blocks.features.to(noise.dtype),
                      context_positions=torch.arange(width, device=device)[None].expand(b, -1),
                      noise_embedding=noise, block_positions=block_pos,
                      attention_mask=core.block_attention_mask(width, blocks.anchors, block_size),
                      block_len=block_size)  # DFlash 2's convolutions stay inside each block
    return hidden.view(b, nb, block_size, -1)


def _ce_chunk(hidden: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
              predecessors: torch.Tensor, model: torch.nn.Module, alpha: float) -> torch.Tensor:
    """Weighted CE sum of a chunk of rows (+ alpha x DFlash 2's weighted selector CE sum)."""
    logits = model.compute_logits(hidden, lm_head).float()
    total = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    if getattr(model, "candidate_selector", None) is not None:
        from torchax_proposer.selector_loss import selector_loss

        mean, _ = selector_loss(model.candidate_selector, hidden, logits, predecessors, labels, weights, alpha=alpha)
        total = total + mean * weights.sum()
    return total


def block_loss(model: torch.nn.Module, embed: torch.Tensor, lm_head: torch.Tensor, blocks: Blocks,
               position_weights: torch.Tensor, *, block_size: int, chunk: int = 8192,
               selector_alpha: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Decay-weighted CE of the supervised block rows over the full vocabulary (chunked and
    recomputed in backward, so the [rows, V] logits never all live at once); for a DFlash 2
    drafter plus its selector's K-way CE, teacher-forced (each position's predecessor is the
    gold token before it, the anchor for the first)."""
    from torchax_proposer.selector_loss import teacher_forced_predecessors

    hidden = draft_hidden(model, embed, blocks, block_size)[:, :, 1:]  # [b, nb, B-1, H]
    w = blocks.label_mask * position_weights.to(blocks.label_mask.device)[None, None, :]
    keep = blocks.label_mask.flatten() > 0
    anchor_ids = torch.gather(blocks.tokens, 1, blocks.anchors)
    predecessors = teacher_forced_predecessors(anchor_ids, blocks.labels).flatten()[keep]
    rows, labels, weights = hidden.flatten(0, 2)[keep], blocks.labels.flatten()[keep], w.flatten()[keep]
    total = torch.zeros((), device=rows.device)
    for i in range(0, len(rows), chunk):
        part = (rows[i : i + chunk], lm_head, labels[i : i + chunk], weights[i : i + chunk],
                predecessors[i : i + chunk], model, selector_alpha)
        if torch.is_grad_enabled():
            total = total + torch.utils.checkpoint.checkpoint(_ce_chunk, *part, use_reentrant=False,
                                                                preserve_rng_state=False)
        else:
            total = total + _ce_chunk(*part)
    loss = total / weights.sum().clamp_min(1e-6)
    return loss, {"loss": float(loss.detach()), "rows": int(keep.sum())}


@torch.no_grad()
def acceptance(model: torch.nn.Module, embed: torch.Tensor, lm_head: torch.Tensor, blocks: Blocks,
               block_size: int, token_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced greedy acceptance per block: (accepted drafts [blocks], correct [blocks, B-1])
    over full blocks (the drafter sees the true committed prefix: exactly greedy spec decoding).
    `token_map` (ids): drafts are the argmax over those ids only, as `--speculative-token-map` serves."""
    hidden = draft_hidden(model, embed, blocks, block_size)[:, :, 1:].flatten(0, 1)  # [blocks, B-1, H]
    if getattr(model, "candidate_selector", None) is not None:  # DFlash 2 drafts the selector's path
        if token_map is not None:
            raise ValueError("held-out tau under a token map is measured for DFlash 1 drafters only")
        anchor_ids = torch.gather(blocks.tokens, 1, blocks.anchors).flatten()
        drafts = torch.cat([model.propose(h, a, lm_head)[0] for h, a in zip(hidden.split(256), anchor_ids.split(256))])
    else:
        head = lm_head if token_map is None else lm_head[token_map]
        drafts = torch.cat([model.compute_logits(h, head).argmax(-1) for h in hidden.split(256)])
        if token_map is not None:  # positions in the map -> token ids
            drafts = token_map[drafts]
    drafts = drafts.view(blocks.labels.shape)
    correct = (drafts == blocks.labels) & (blocks.label_mask > 0)
    full = blocks.label_mask.sum(-1) == block_size - 1
    accepted = torch.cumprod(correct.long(), -1).sum(-1)
    return accepted[full], correct[full]


def evaluate(model, target: FeatureTarget, seqs: Sequence[TrainSequence], block_size: int, *,
             max_anchors: int = 512, batch: int = 8, token_map: Sequence[int] | None = None) -> dict:
    """Held-out teacher-forced tau (1 + accepted drafts per full block) and per-position acceptance
    (drafting over `token_map`'s ids only, when given)."""
    ids = None if token_map is None else torch.as_tensor(list(token_map), dtype=torch.long, device=target.device)
    was_training = model.training
    model.eval()
    accepted, correct = [], []
    for i in range(0, len(seqs), batch):
        part = seqs[i : i + batch]
        tokens = device_batch(part, target.device)
        features, next_ids = target(tokens)
        blocks = make_blocks(part, tokens, features, next_ids, block_size=block_size, max_anchors=max_anchors,
                             rng=None, full_blocks_only=True)
        if blocks is None:
            continue
        with autocast(target.device):
            a, c = acceptance(model, target.embed, target.lm_head, blocks, block_size, ids)
        accepted.append(a.cpu())
        correct.append(c.cpu())
    model.train(was_training)
    if not accepted:
        return {}
    a, c = torch.cat(accepted).float(), torch.cat(correct).float()
    # Acceptance rate at offset k: P(drafts 1..k all correct).
    lead = torch.cumprod(c, -1).mean(0)
    return {"block_size": block_size, **({} if ids is None else {"token_map_ids": len(ids)}),
            "tau": round(float(1 + a.mean()), 4), "blocks": int(len(a)),
            "sequences": len(seqs), "accept_rate_per_position": [round(float(x), 4) for x in lead],
            "accuracy_per_position": [round(float(x), 4) for x in c.mean(0)]}


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
