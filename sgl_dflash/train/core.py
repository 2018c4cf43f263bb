"""DFlash drafter training: the pieces that define what is learned, and a small in-memory trainer.

Recipe (DFlash paper arXiv 2602.06036, SpecForge):
- the target is frozen (its embedding and lm_head too); the drafter's layers, `fc` and norms train;
- anchors: random positions `i` where tokens `i` and `i+1` are supervised (response tokens);
- block input `[x_anchor, MASK x (B-1)]` at positions `anchor .. anchor+B-1`;
- attention: block b sees context features at positions STRICTLY before anchor_b (exactly what it
  will see at inference: features of committed tokens only; the anchor token is the bonus token
  whose features do not exist yet) plus its own block, bidirectionally;
- loss: sum_k w_k CE(lm_head(h_k), x_{anchor+k}) / sum_k w_k, k = 1..B-1, w_k = exp(-(k-1)/gamma);
- AdamW lr 6e-4, cosine schedule with 4% warmup, gradient clipping at 1.0.

Context features are the target's layer OUTPUTS `hidden_states[l + 1]` for l in target_layer_ids.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

_GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


class TrainingDataError(ValueError):
    """Training inputs are unusable (empty, too short, mismatched shapes); the message says which."""


# ----------------------------------------------------------------------------------------------
# Drafter construction
# ----------------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """z-lab's default: the middle layer for one id, else evenly spread over [1, n-3]."""
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_ids - 1)) for i in range(num_ids)]


def loss_gamma(block_size: int) -> float:
    """Decay of the per-position loss weights: the paper's values, interpolated elsewhere."""
    if block_size in _GAMMA_BY_BLOCK_SIZE:
        return _GAMMA_BY_BLOCK_SIZE[block_size]
    return max(1.0, 4.0 + 3.0 * (block_size - 8) / 8)


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block offsets k = 1..B-1 (offset 0 is the given anchor token)."""
    gamma = loss_gamma(block_size) if gamma is None else gamma
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def build_draft_config(
    target_config: dict,
    *,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
) -> dict:
    """A z-lab DFlash config.json dict for a drafter of `target_config` (an HF config dict).

    The drafter shares the target's hidden size (it uses the target's embedding and lm_head) and
    attention geometry. `mask_token_id` defaults to the last vocabulary id.
    """
    num_target_layers = int(target_config["num_hidden_layers"])
    hidden = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise TrainingDataError(f"target_layer_ids {bad} outside [0, {num_target_layers})")
    vocab_size = int(target_config["vocab_size"])
    if mask_token_id is None:
        mask_token_id = vocab_size - 1
    if not 0 <= mask_token_id < vocab_size:
        raise TrainingDataError(f"mask_token_id {mask_token_id} outside the vocabulary [0, {vocab_size})")
    rope_theta = target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0
    )
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": int(intermediate_size or target_config["intermediate_size"]),
        "num_hidden_layers": int(num_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_config.get("num_key_value_heads", heads)),
        "head_dim": int(target_config.get("head_dim") or hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(target_config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 8192)),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "num_target_layers": num_target_layers,
        "block_size": int(block_size),
        "dflash_config": {
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": target_layer_ids,
            "block_size": int(block_size),
        },
        "torch_dtype": "float32",
    }


def new_draft_model(config: dict, *, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised `DFlashDraftModel` (z-lab parameter names) in float32.

    Linear weights ~ N(0, 0.02) like transformers' Qwen3 init; norms start at one.
    """
    from torchax_proposer import DFlashConfig, DFlashDraftModel

    torch.manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(config)).to(torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, 0.02)
                if module.bias is not None:
                    module.bias.zero_()
    return model


# ----------------------------------------------------------------------------------------------
# Target features
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def target_features(target: torch.nn.Module, token_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """Aux features `[batch, seq, len(layer_ids) * H]`: outputs of the target's layers `layer_ids`.

    `hidden_states[0]` is the embedding output, so layer l's OUTPUT is `hidden_states[l + 1]`.
    """
    out = target(token_ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1)


# ----------------------------------------------------------------------------------------------
# Anchors, attention mask, loss
# ----------------------------------------------------------------------------------------------


def valid_anchor_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions i where i and i+1 are both supervised: the block's first draft has a label."""
    loss_mask = np.asarray(loss_mask, dtype=bool)
    return np.flatnonzero(loss_mask[:-1] & loss_mask[1:])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `num_anchors` distinct random anchors, sorted; empty when the sequence has none."""
    candidates = valid_anchor_positions(loss_mask)
    if len(candidates) <= num_anchors:
        return candidates
    return np.sort(rng.choice(candidates, size=num_anchors, replace=False))


def block_attention_mask(seq_len: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean mask `[batch, 1, nb*B, seq_len + nb*B]` (True = may attend).

    Keys are `[context features (seq_len) | all blocks (nb*B)]`. Query rows of block b see context
    positions `< anchors[:, b]` and the B rows of block b. `anchors`: int64 `[batch, nb]`; padded
    anchor slots are fine (their rows are ignored by the loss).
    """
    batch, num_blocks = anchors.shape
    q_block = torch.arange(num_blocks * block_size, device=anchors.device) // block_size  # [Q]
    row_anchor = anchors[:, q_block]  # [batch, Q]
    ctx_visible = torch.arange(seq_len, device=anchors.device)[None, None, :] < row_anchor[:, :, None]
    same_block = q_block[:, None] == q_block[None, :]
    block_visible = same_block[None].expand(batch, -1, -1)
    return torch.cat([ctx_visible, block_visible], dim=-1)[:, None]


@dataclass
class Batch:
    """One training batch: `batch` sequences padded to `seq_len`, `nb` anchors each."""

    token_ids: torch.Tensor  # int64 [batch, seq_len]
    features: torch.Tensor  # float [batch, seq_len, n_aux*H]
    anchors: torch.Tensor  # int64 [batch, nb]
    labels: torch.Tensor  # int64 [batch, nb, B-1]  (tokens at anchor+1 .. anchor+B-1)
    label_mask: torch.Tensor  # float [batch, nb, B-1]  (1 = supervised)


def make_batch(
    token_ids: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    features: Sequence[torch.Tensor],
    *,
    block_size: int,
    num_anchors: int,
    rng: np.random.Generator,
) -> Batch | None:
    """Sample anchors for each sequence and pack everything into padded tensors.

    Returns None when no sequence has a valid anchor.
    """
    anchors_per_seq = [sample_anchors(m, num_anchors, rng) for m in loss_masks]
    nb = max((len(a) for a in anchors_per_seq), default=0)
    if nb == 0:
        return None
    seq_len = max(len(t) for t in token_ids)
    batch = len(token_ids)
    feat_dim = features[0].shape[-1]
    tokens = torch.zeros(batch, seq_len, dtype=torch.int64)
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    feats = torch.zeros(batch, seq_len, feat_dim, dtype=features[0].dtype)
    anchors = torch.zeros(batch, nb, dtype=torch.int64)
    anchor_valid = torch.zeros(batch, nb, dtype=torch.bool)
    for i, (t, m, f, a) in enumerate(zip(token_ids, loss_masks, features, anchors_per_seq)):
        n = len(t)
        tokens[i, :n] = torch.as_tensor(np.asarray(t), dtype=torch.int64)
        mask[i, :n] = torch.as_tensor(np.asarray(m, dtype=bool))
        feats[i, :n] = torch.as_tensor(f)
        if len(a):
            anchors[i, : len(a)] = torch.as_tensor(a, dtype=torch.int64)
            # Padded slots repeat the first anchor (a real position) and are masked out below.
            anchors[i, len(a):] = int(a[0])
            anchor_valid[i, : len(a)] = True
    offsets = torch.arange(1, block_size)
    label_pos = anchors[:, :, None] + offsets  # [batch, nb, B-1]
    in_range = label_pos < seq_len
    label_pos = label_pos.clamp(max=seq_len - 1)
    labels = torch.gather(tokens[:, None, :].expand(-1, nb, -1), 2, label_pos)
    supervised = torch.gather(mask[:, None, :].expand(-1, nb, -1), 2, label_pos)
    label_mask = (in_range & supervised & anchor_valid[:, :, None]).float()
    return Batch(tokens, feats, anchors, labels, label_mask)


def draft_hidden(model: torch.nn.Module, embed: torch.Tensor, batch: Batch, *, block_size: int) -> torch.Tensor:
    """Drafter outputs for every block row, `[batch, nb, B, H]`: all blocks of a sequence run in one
    row, the attention mask keeps each block to its own context prefix and its own rows."""
    bsz, nb = batch.anchors.shape
    seq_len = batch.token_ids.shape[1]
    block_tokens = torch.full((bsz, nb, block_size), model.mask_token_id, dtype=torch.int64)
    block_tokens[:, :, 0] = torch.gather(batch.token_ids, 1, batch.anchors)
    noise = model.embed_block(block_tokens.view(bsz, nb * block_size), embed).to(batch.features.dtype)
    block_pos = (batch.anchors[:, :, None] + torch.arange(block_size)).view(bsz, nb * block_size)
    hidden, _ = model(
        context_features=batch.features,
        context_positions=torch.arange(seq_len)[None].expand(bsz, -1),
        noise_embedding=noise,
        block_positions=block_pos,
        attention_mask=block_attention_mask(seq_len, batch.anchors, block_size),
    )
    return hidden.view(bsz, nb, block_size, -1)


def dflash_loss(model: torch.nn.Module, embed: torch.Tensor, lm_head: torch.Tensor, batch: Batch, *,
                block_size: int, weights: torch.Tensor, sampled_positions: int | None = None,
                generator: torch.Generator | None = None,
                vocab: "TrainVocab | None" = None) -> tuple[torch.Tensor, dict]:
    """Decay-weighted CE over block offsets 1..B-1; returns (loss, stats).

    The lm_head over the full vocabulary dominates the cost on a CPU. `sampled_positions=n` draws n
    offsets per step with probability proportional to w_k and averages their CE: an estimate of
    the same weighted loss at n/(B-1) of the lm_head cost (stats then hold the loss only).
    `vocab` restricts the softmax to the tokens the training responses use (labels outside it are
    not supervised): the same ranking problem at a fraction of the lm_head cost.
    """
    hidden = draft_hidden(model, embed, batch, block_size=block_size)[:, :, 1:]
    labels, label_mask = batch.labels, batch.label_mask
    if sampled_positions:
        offsets = torch.multinomial(weights, sampled_positions, replacement=True, generator=generator)
        hidden, labels, label_mask = hidden[:, :, offsets], labels[:, :, offsets], label_mask[:, :, offsets]
    if vocab is not None:
        labels = vocab.index[labels]
        label_mask = label_mask * (labels >= 0)
        labels = labels.clamp_min(0)
        lm_head = vocab.rows(lm_head, generator)
    # Sampled offsets were drawn with p ~ w_k already: each counts once.
    w = label_mask if sampled_positions else weights[None, None, :] * label_mask
    logits = model.compute_logits(hidden, lm_head)  # [batch, nb, positions, V]
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none").view_as(w)
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    if sampled_positions:
        return loss, {"loss": float(loss.detach()), "tau": float("nan"), "acc_per_pos": []}
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels).float() * label_mask
        per_pos = correct.sum((0, 1)) / label_mask.sum((0, 1)).clamp_min(1)
        # Accepted length of a block = 1 + leading correct drafts (meaningful on greedy data).
        lead = torch.cumprod(correct, dim=-1).sum(-1)
        valid_blocks = label_mask[:, :, 0] > 0
        tau = (1 + lead[valid_blocks]).mean() if valid_blocks.any() else torch.tensor(float("nan"))
    return loss, {"loss": float(loss.detach()), "acc_per_pos": per_pos.tolist(), "tau": float(tau)}


class TrainVocab:
    """A sampled softmax for CPU training: the token ids the training responses use (every label
    lives there) plus `num_negatives` other ids drawn afresh each step, so the rest of the
    vocabulary is pushed down too and full-vocabulary argmax stays right at inference."""

    def __init__(self, token_ids: torch.Tensor, vocab_size: int, num_negatives: int = 2048):
        self.ids = torch.unique(torch.as_tensor(token_ids, dtype=torch.int64))
        self.index = torch.full((vocab_size,), -1, dtype=torch.int64)  # full id -> subset row (-1: absent)
        self.index[self.ids] = torch.arange(len(self.ids))
        others = torch.ones(vocab_size, dtype=torch.bool)
        others[self.ids] = False
        self.others = torch.nonzero(others).flatten()
        self.num_negatives = min(num_negatives, len(self.others))

    def rows(self, lm_head: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """lm_head rows of the used ids (in `index` order) followed by fresh negatives."""
        pick = torch.randperm(len(self.others), generator=generator)[: self.num_negatives]
        return lm_head[torch.cat([self.ids, self.others[pick]])]

    def __len__(self) -> int:
        return len(self.ids)


# ----------------------------------------------------------------------------------------------
# Optimisation
# ----------------------------------------------------------------------------------------------


def lr_at(step: int, total_steps: int, lr: float, warmup_frac: float = 0.04) -> float:
    """Linear warmup over `warmup_frac` of the steps, then cosine decay to zero."""
    warmup = max(1, int(round(warmup_frac * total_steps)))
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                             betas=(0.9, 0.95), weight_decay=weight_decay)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
                   lr: float, clip: float = 1.0) -> float:
    """Backward, clip the global grad norm to `clip`, step at learning rate `lr`; returns the norm."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return float(norm)


# ----------------------------------------------------------------------------------------------
# Checkpoint output (z-lab format)
# ----------------------------------------------------------------------------------------------


def save_draft_checkpoint(model: torch.nn.Module, config: dict, out_dir: str | os.PathLike, *,
                          dtype: torch.dtype = torch.float32, extra: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (no `model.` prefix, no embedding/lm_head)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in model.state_dict().items()}
    config = dict(config)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["dtype"] = config["torch_dtype"]
    if extra:
        config.update(extra)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


# ----------------------------------------------------------------------------------------------
# Small in-memory trainer
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    out_dir: Path
    losses: list[float] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)


def load_frozen_target(target_dir: str | os.PathLike) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def target_embed_and_head(target: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings()
    return embed, (head.weight.detach() if head is not None else embed)


def train_drafter(
    target_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    sequences: Sequence[Sequence[int]],
    *,
    loss_mask: Sequence[Sequence[bool]] | None = None,
    num_layers: int = 1,
    block_size: int = 8,
    steps: int = 200,
    batch_size: int = 8,
    num_anchors: int = 16,
    lr: float = 6e-4,
    seed: int = 0,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    save_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    log: Callable[[int, dict], None] | None = None,
) -> TrainResult:
    """Train a DFlash drafter for the HF target in `target_dir` on token `sequences` (in memory).

    `loss_mask[i][j]` marks supervised tokens (default: all). Target features are computed once.
    Writes a z-lab checkpoint to `out_dir` (config records target and recipe) and returns it with
    the loss curve.
    """
    if not sequences:
        raise TrainingDataError("sequences is empty")
    if loss_mask is None:
        loss_mask = [[True] * len(s) for s in sequences]
    if len(loss_mask) != len(sequences) or any(len(m) != len(s) for m, s in zip(loss_mask, sequences)):
        raise TrainingDataError("loss_mask must have one entry per token of every sequence")
    token_arrays = [np.asarray(s, dtype=np.int64) for s in sequences]
    mask_arrays = [np.asarray(m, dtype=bool) for m in loss_mask]
    if not any(len(valid_anchor_positions(m)) for m in mask_arrays):
        raise TrainingDataError("no sequence has two consecutive supervised tokens (no anchors)")

    target = load_frozen_target(target_dir)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    config = build_draft_config(target_config, num_layers=num_layers, block_size=block_size,
                                target_layer_ids=target_layer_ids, mask_token_id=mask_token_id)
    layer_ids = config["dflash_config"]["target_layer_ids"]
    features = [target_features(target, torch.as_tensor(t)[None], layer_ids)[0] for t in token_arrays]
    embed, lm_head = target_embed_and_head(target)

    model = new_draft_model(config, seed=seed).train()
    optimizer = make_optimizer(model, lr)
    weights = loss_weights(block_size)
    rng = np.random.default_rng(seed)
    result = TrainResult(Path(out_dir))
    bar = tqdm(range(steps), desc="train drafter", disable=not progress)
    for step in bar:
        pick = rng.choice(len(token_arrays), size=min(batch_size, len(token_arrays)), replace=False)
        batch = make_batch([token_arrays[i] for i in pick], [mask_arrays[i] for i in pick],
                           [features[i] for i in pick], block_size=block_size,
                           num_anchors=num_anchors, rng=rng)
        if batch is None:
            continue
        loss, stats = dflash_loss(model, embed, lm_head, batch, block_size=block_size, weights=weights)
        optimizer_step(model, optimizer, loss, lr_at(step, steps, lr))
        result.losses.append(stats["loss"])
        result.taus.append(stats["tau"])
        bar.set_postfix(loss=f"{stats['loss']:.3f}", tau=f"{stats['tau']:.2f}")
        if log is not None:
            log(step, stats)

    recipe = {
        "target": {"path": str(target_dir), "model_type": target_config.get("model_type"),
                   "num_hidden_layers": target_config["num_hidden_layers"]},
        "training": {"steps": steps, "batch_size": batch_size, "anchors_per_sequence": num_anchors,
                     "lr": lr, "schedule": "cosine, 4% warmup", "optimizer": "AdamW", "grad_clip": 1.0,
                     "loss_gamma": loss_gamma(block_size), "seed": seed,
                     "num_sequences": len(token_arrays), "date": time.strftime("%Y-%m-%d")},
    }
    save_draft_checkpoint(model.eval(), config, out_dir, dtype=save_dtype, extra=recipe)
    return result
