"""Drafter training on the kept response set, target features computed on the fly.

One step: a batch of (prompt + response) sequences of similar length goes through the frozen
target once (its prefill gives the context features of `target_layer_ids` and, from its final
hidden states, the target's own greedy next token at every position); then every valid anchor of
each response (up to `max_anchors`, drawn afresh each time) becomes a block
`[x_anchor, MASK x (B-1)]` and the drafter is trained to predict the target's greedy tokens.

Labels are the target's argmax on the prefilled text, not the stored tokens: on greedy responses
they are the same tokens, and on sampled text they are the exact greedy labels as long as the text
agrees with the target — offset k of a block is supervised only while the text's tokens at
offsets 1..k-1 equal the target's argmax (what acceptance needs). Verbatim loops at the end of a
response are cut after three periods: they are trivially predictable and would crowd out real text.

Runs on CUDA (bf16 autocast for the drafter, TF32 for the target's prefill) and on CPU (fp32;
tests and small runs). Resumable: `train_state.pt` in the output directory, saved every
`save_every_s` seconds; a time budget fixes the number of steps after a short warm-up so that the
cosine schedule ends inside the budget.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from tqdm import tqdm

from sgl_dflash.train import core
from sgl_dflash.train.responses import Response, ResponseSet
from torchax_proposer import default_target_layer_ids


@dataclass
class TrainConfig:
    num_layers: int = 3
    block_size: int = 8
    num_feature_layers: int = 5
    target_layer_ids: tuple[int, ...] | None = None  # default: num_feature_layers spread over [1, L-3]
    mask_token_id: int | None = None
    max_anchors: int = 512
    tokens_per_batch: int = 16384  # padded prompt+response tokens per step
    max_seq_len: int = 1024
    epochs: float = 4.0
    steps: int | None = None  # a fixed step count instead of `epochs`
    time_budget_s: float | None = None  # fixes the step count after `probe_steps` steps
    probe_steps: int = 20
    lr: float = 6e-4
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_gamma: float | None = None
    sampling: str | None = None  # train only on shards with this sampling ("greedy"); None: all
    trim_loops: bool = True
    holdout: int = 64
    init_layers_from_target: bool = False
    init_from: str | None = None
    feature_noise: float = 0.0  # uniform noise added to the context features (EAGLE-1)
    dflash2: dict | None = None  # conv_kernel_size, conv_group_size, selector_rank, selector_top_k
    selector_alpha: float = 1.0  # weight of DFlash 2's selector loss next to the block loss
    save_every_s: float = 300.0
    seed: int = 0


# ------------------------------------------------------------------------------------------------
# Sequences
# ------------------------------------------------------------------------------------------------


@dataclass
class TrainSequence:
    id: str
    tokens: np.ndarray  # int64 prompt + (trimmed) response
    response_start: int
    greedy: bool


def loop_start(tokens: np.ndarray, *, tail: int = 120, max_period: int = 40) -> tuple[int, int] | None:
    """(start, period) of a verbatim loop that ends `tokens`: the last `tail` tokens repeat with a
    period <= `max_period`, and tokens[start:] is periodic. None when the end is not a loop."""
    n = len(tokens)
    if n < tail:
        return None
    window = tokens[n - tail:]
    for period in range(1, max_period + 1):
        if np.array_equal(window[period:], window[:-period]):
            start = n - tail
            while start > 0 and tokens[start - 1] == tokens[start - 1 + period]:
                start -= 1
            return start, period
    return None


def to_train_sequence(row: Response, *, trim_loops: bool, max_seq_len: int) -> TrainSequence:
    output = row.output_ids
    if trim_loops:
        found = loop_start(output)
        if found is not None:
            start, period = found
            output = output[: start + 3 * period]
    tokens = np.concatenate([row.prompt_ids, output])[:max_seq_len]
    return TrainSequence(row.id, tokens.astype(np.int64), len(row.prompt_ids), row.greedy)


def split_holdout(rows: Sequence[Response], holdout: int) -> tuple[list[Response], list[Response]]:
    """(train, held out): the held-out rows are greedy rows picked by a hash of their id, so the
    split does not move when shards are added."""
    import hashlib

    def key(row: Response) -> str:
        return hashlib.sha1(row.id.encode()).hexdigest()

    greedy = sorted((r for r in rows if r.greedy), key=key)
    held = {r.id for r in greedy[:holdout]}
    # Other responses to a held-out prompt (sampled ones) stay out of training too.
    return [r for r in rows if r.id not in held], greedy[:holdout]


def length_batches(seqs: Sequence[TrainSequence], tokens_per_batch: int, rng: np.random.Generator) -> list[list[int]]:
    """Batches of sequence indices with similar lengths (little padding), in random order."""
    order = rng.permutation(len(seqs))
    # Sort within large windows: batches of similar length, still a fresh mix every epoch.
    window = 4096
    order = np.concatenate([sorted(order[i : i + window], key=lambda j: len(seqs[j].tokens))
                            for i in range(0, len(order), window)]) if len(order) else order
    batches, current, width = [], [], 0
    for j in order:
        n = len(seqs[j].tokens)
        if current and max(width, n) * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current, width = [], 0
        current.append(int(j))
        width = max(width, n)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


# ------------------------------------------------------------------------------------------------
# The frozen target: features and greedy labels in one prefill
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# Blocks, labels and the loss
# ------------------------------------------------------------------------------------------------


@dataclass
class Blocks:
    tokens: torch.Tensor  # int64 [b, S]
    features: torch.Tensor  # [b, S, n*H]
    anchors: torch.Tensor  # int64 [b, nb]
    labels: torch.Tensor  # int64 [b, nb, B-1]: the target's greedy token at anchor+k
    label_mask: torch.Tensor  # float [b, nb, B-1]


def make_blocks(seqs: Sequence[TrainSequence], tokens: torch.Tensor, features: torch.Tensor, next_ids: torch.Tensor,
                *, block_size: int, max_anchors: int, rng: np.random.Generator | None,
                full_blocks_only: bool = False) -> Blocks | None:
    """Anchors in every response (a random subset of `max_anchors` when there are more; all of
    them in order when `rng` is None) and their labels. `full_blocks_only` keeps anchors whose
    B-1 labels all lie inside the response (evaluation)."""
    device = tokens.device
    per_seq = []
    for s in seqs:
        end = len(s.tokens) - (block_size - 1 if full_blocks_only else 1)
        cand = np.arange(s.response_start, max(s.response_start, end))
        if len(cand) > max_anchors:
            cand = np.sort(rng.choice(cand, size=max_anchors, replace=False)) if rng is not None else cand[:max_anchors]
        per_seq.append(cand)
    nb = max(len(a) for a in per_seq)
    if nb == 0:
        return None
    anchors = np.zeros((len(seqs), nb), dtype=np.int64)
    valid = np.zeros((len(seqs), nb), dtype=bool)
    lengths = np.array([len(s.tokens) for s in seqs])
    for i, a in enumerate(per_seq):
        anchors[i, : len(a)] = a
        anchors[i, len(a):] = a[0] if len(a) else 0
        valid[i, : len(a)] = True
    anchors_t = torch.as_tensor(anchors, device=device)
    width = tokens.shape[1]
    offsets = torch.arange(1, block_size, device=device)
    pos = anchors_t[:, :, None] + offsets  # [b, nb, B-1]: positions of the labelled tokens
    in_range = pos < torch.as_tensor(lengths, device=device)[:, None, None]
    pos_c = pos.clamp(max=width - 1)
    gather = lambda x: torch.gather(x[:, None, :].expand(-1, nb, -1), 2, pos_c)  # noqa: E731
    labels = gather(next_ids.roll(1, dims=1))  # the target's greedy token AT pos (predicted at pos-1)
    text = gather(tokens)
    # Offset k is supervised while the text agrees with the target at offsets 1..k-1.
    agree = torch.cumprod(torch.cat([torch.ones_like(text[:, :, :1]), (text == labels)[:, :, :-1].long()], -1), -1)
    mask = in_range & (agree > 0) & torch.as_tensor(valid, device=device)[:, :, None]
    return Blocks(tokens, features, anchors_t, labels, mask.float())


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
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced greedy acceptance per block: (accepted drafts [blocks], correct [blocks, B-1])
    over full blocks (the drafter sees the true committed prefix: exactly greedy spec decoding)."""
    hidden = draft_hidden(model, embed, blocks, block_size)[:, :, 1:].flatten(0, 1)  # [blocks, B-1, H]
    if getattr(model, "candidate_selector", None) is not None:  # DFlash 2 drafts the selector's path
        anchor_ids = torch.gather(blocks.tokens, 1, blocks.anchors).flatten()
        drafts = torch.cat([model.propose(h, a, lm_head)[0] for h, a in zip(hidden.split(256), anchor_ids.split(256))])
    else:
        drafts = torch.cat([model.compute_logits(h, lm_head).argmax(-1) for h in hidden.split(256)])
    drafts = drafts.view(blocks.labels.shape)
    correct = (drafts == blocks.labels) & (blocks.label_mask > 0)
    full = blocks.label_mask.sum(-1) == block_size - 1
    accepted = torch.cumprod(correct.long(), -1).sum(-1)
    return accepted[full], correct[full]


# ------------------------------------------------------------------------------------------------
# The training run
# ------------------------------------------------------------------------------------------------


def _device_batch(seqs: Sequence[TrainSequence], device: torch.device) -> torch.Tensor:
    width = max(len(s.tokens) for s in seqs)
    tokens = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s.tokens)] = s.tokens
    return torch.as_tensor(tokens, device=device)


def evaluate(model, target: FeatureTarget, seqs: Sequence[TrainSequence], block_size: int, *,
             max_anchors: int = 512, batch: int = 8) -> dict:
    """Held-out teacher-forced tau (1 + accepted drafts per full block) and per-position acceptance."""
    was_training = model.training
    model.eval()
    accepted, correct = [], []
    for i in range(0, len(seqs), batch):
        part = seqs[i : i + batch]
        tokens = _device_batch(part, target.device)
        features, next_ids = target(tokens)
        blocks = make_blocks(part, tokens, features, next_ids, block_size=block_size, max_anchors=max_anchors,
                             rng=None, full_blocks_only=True)
        if blocks is None:
            continue
        with _autocast(target.device):
            a, c = acceptance(model, target.embed, target.lm_head, blocks, block_size)
        accepted.append(a.cpu())
        correct.append(c.cpu())
    model.train(was_training)
    if not accepted:
        return {}
    a, c = torch.cat(accepted).float(), torch.cat(correct).float()
    # Acceptance rate at offset k: P(drafts 1..k all correct).
    lead = torch.cumprod(c, -1).mean(0)
    return {"block_size": block_size, "tau": round(float(1 + a.mean()), 4), "blocks": int(len(a)),
            "sequences": len(seqs), "accept_rate_per_position": [round(float(x), 4) for x in lead],
            "accuracy_per_position": [round(float(x), 4) for x in c.mean(0)]}


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(target_dir: str | os.PathLike, data: ResponseSet | Sequence[Response], out_dir: str | os.PathLike,
          cfg: TrainConfig, *, device: str | torch.device | None = None, max_steps_this_call: int | None = None,
          progress: bool = True, save_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Train (or resume) a drafter on `data`; writes the z-lab checkpoint and `train_log.json` to
    `out_dir` and returns the final summary (held-out tau included)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the target's prefill: features to ~1e-3
        torch.backends.cudnn.allow_tf32 = True
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    layer_ids = list(cfg.target_layer_ids or default_target_layer_ids(
        int(target_config["num_hidden_layers"]), cfg.num_feature_layers))
    draft_config = core.build_draft_config(target_config, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                           target_layer_ids=layer_ids, mask_token_id=cfg.mask_token_id,
                                           dflash2=cfg.dflash2)

    rows = [r for r in data if cfg.sampling is None or r.sampling == cfg.sampling]
    train_rows, held_rows = split_holdout(rows, cfg.holdout)
    seqs = [to_train_sequence(r, trim_loops=cfg.trim_loops, max_seq_len=cfg.max_seq_len) for r in train_rows]
    seqs = [s for s in seqs if len(s.tokens) - s.response_start >= 2]
    # Held out with loops cut too: tau then measures real text, not copied loops.
    held = [to_train_sequence(r, trim_loops=cfg.trim_loops, max_seq_len=cfg.max_seq_len) for r in held_rows]
    if not seqs:
        raise core.TrainingDataError("no training sequence has a response of two tokens or more")

    target = FeatureTarget(target_dir, layer_ids, device)
    model = core.new_draft_model(draft_config, seed=cfg.seed)
    with torch.no_grad():  # start at the target's output scale: its final norm feeds the same lm_head
        model.norm.weight.copy_(_target_final_norm(target.model))
    if cfg.init_layers_from_target:
        core.init_from_target_layers(model, target_dir, layer_ids)
    if cfg.init_from:
        from safetensors.torch import load_file

        init = load_file(str(Path(cfg.init_from) / "model.safetensors"))
        model.load_state_dict({k: v.to(torch.float32) for k, v in init.items()})
    model = model.to(device).train()
    optimizer = core.make_optimizer(model, cfg.lr, cfg.weight_decay)
    weights = core.loss_weights(cfg.block_size, cfg.loss_gamma)

    steps_per_epoch = len(length_batches(seqs, cfg.tokens_per_batch, np.random.default_rng(0)))
    total_steps = cfg.steps if cfg.steps is not None else max(1, int(cfg.epochs * steps_per_epoch))
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "total_steps": total_steps,
             "steps_fixed": cfg.time_budget_s is None, "elapsed_s": 0.0, "log": []}
    state_path = out_dir / "train_state.pt"
    if state_path.is_file():
        saved = torch.load(state_path, map_location="cpu", weights_only=False)
        if saved["config"] != asdict(cfg):
            raise core.TrainingDataError(f"{state_path} was written with another config: {saved['config']}")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]

    def save(final: bool = False) -> dict:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"config": asdict(cfg), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "state": state}, tmp)
        tmp.replace(state_path)
        summary = _summary(cfg, draft_config, target_dir, state, len(seqs), len(held), rows)
        if final and held:
            summary["held_out"] = {f"B{b}": evaluate(model, target, held, b) for b in sorted({4, cfg.block_size})}
        core.save_draft_checkpoint(model, draft_config, out_dir, dtype=save_dtype, extra={"training": summary})
        (out_dir / "train_log.json").write_text(json.dumps({"summary": summary, "log": state["log"]}, indent=1))
        return summary

    rng_epoch = lambda e: np.random.default_rng([cfg.seed, e])  # noqa: E731 - the order of epoch e
    batches = length_batches(seqs, cfg.tokens_per_batch, rng_epoch(state["epoch"]))
    bar = tqdm(total=state["total_steps"], initial=state["step"], desc="train drafter", unit="step",
               disable=not progress)
    start, last_save, steps_this_call = time.perf_counter(), time.perf_counter(), 0
    elapsed0 = state["elapsed_s"]
    while state["step"] < state["total_steps"]:
        if max_steps_this_call is not None and steps_this_call >= max_steps_this_call:
            break
        if state["batch_in_epoch"] >= len(batches):
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
            batches = length_batches(seqs, cfg.tokens_per_batch, rng_epoch(state["epoch"]))
        part = [seqs[j] for j in batches[state["batch_in_epoch"]]]
        tokens = _device_batch(part, device)
        features, next_ids = target(tokens)
        # Randomness is a function of (seed, step) alone: a resumed run draws what an uninterrupted one would.
        if cfg.feature_noise:
            gen = torch.Generator(device).manual_seed(cfg.seed * 1_000_003 + state["step"])
            noise = torch.rand(features.shape, generator=gen, device=device, dtype=features.dtype)
            features = features + (noise * 2 - 1) * cfg.feature_noise
        blocks = make_blocks(part, tokens, features, next_ids, block_size=cfg.block_size,
                             max_anchors=cfg.max_anchors, rng=np.random.default_rng([cfg.seed, state["step"]]))
        state["batch_in_epoch"] += 1
        if blocks is None:
            continue
        lr = core.lr_at(state["step"], state["total_steps"], cfg.lr)
        with _autocast(device):
            loss, stats = block_loss(model, target.embed, target.lm_head, blocks, weights, block_size=cfg.block_size,
                                     selector_alpha=cfg.selector_alpha)
        grad_norm = core.optimizer_step(model, optimizer, loss, lr, cfg.grad_clip)
        state["step"] += 1
        steps_this_call += 1
        state["elapsed_s"] = elapsed0 + time.perf_counter() - start
        if not state["steps_fixed"] and state["step"] >= cfg.probe_steps:
            per_step = state["elapsed_s"] / state["step"]
            state["total_steps"] = max(state["step"] + 1, int(cfg.time_budget_s / per_step))
            state["steps_fixed"] = True
            bar.total = state["total_steps"]
        state["log"].append({"step": state["step"], "loss": round(stats["loss"], 4), "lr": lr,
                             "grad_norm": round(grad_norm, 3), "rows": stats["rows"],
                             "elapsed_s": round(state["elapsed_s"], 1), "epoch": state["epoch"]})
        bar.update()
        bar.set_postfix(loss=f"{stats['loss']:.3f}", ep=state["epoch"])
        if time.perf_counter() - last_save > cfg.save_every_s:
            save()
            last_save = time.perf_counter()
    bar.close()
    return save(final=state["step"] >= state["total_steps"])


def _target_final_norm(target: torch.nn.Module) -> torch.Tensor:
    return target.model.norm.weight.detach().float().cpu()


def _summary(cfg: TrainConfig, draft_config: dict, target_dir, state: dict, num_train: int, num_held: int,
             rows: Sequence[Response]) -> dict:
    recent = state["log"][-50:]
    return {
        "recipe": asdict(cfg),
        "target_layer_ids": draft_config["dflash_config"]["target_layer_ids"],
        "target": Path(target_dir).name,
        "optimizer": "AdamW(0.9, 0.95)", "schedule": "cosine, 4% warmup",
        "loss_gamma": core.loss_gamma(cfg.block_size) if cfg.loss_gamma is None else cfg.loss_gamma,
        "labels": "target argmax on the prefilled text, supervised while the text agrees",
        "data": {"train_sequences": num_train, "held_out_sequences": num_held,
                 "response_tokens": int(sum(len(r.output_ids) for r in rows)),
                 "by_sampling": {s: sum(r.sampling == s for r in rows) for s in sorted({r.sampling for r in rows})}},
        "steps_done": state["step"], "total_steps": state["total_steps"], "epochs_done": state["epoch"],
        "train_seconds": round(state["elapsed_s"], 1),
        "recent_train_loss": round(float(np.mean([r["loss"] for r in recent])), 4) if recent else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def evaluate_checkpoint(target_dir: str | os.PathLike, data: ResponseSet | Sequence[Response],
                        draft_dir: str | os.PathLike, block_sizes: Sequence[int] = (4, 8), *, holdout: int = 64,
                        trim_loops: bool = True, device: str | torch.device | None = None) -> dict:
    """Held-out teacher-forced tau of a saved drafter on the same split `train` holds out."""
    from torchax_proposer import load_draft_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    model = load_draft_model(draft_dir, target_config).to(device)
    _, held_rows = split_holdout(list(data), holdout)
    held = [to_train_sequence(r, trim_loops=trim_loops, max_seq_len=1024) for r in held_rows]
    target = FeatureTarget(target_dir, model.target_layer_ids, device)
    return {f"B{b}": evaluate(model, target, held, b) for b in block_sizes}


def train_drafter(target_dir: str | os.PathLike, out_dir: str | os.PathLike, sequences: Sequence[Sequence[int]],
                  *, prompt_lens: Sequence[int] | None = None, num_layers: int = 1, block_size: int = 8,
                  steps: int = 200, batch_size: int = 8, num_anchors: int = 16, lr: float = 6e-4, seed: int = 0,
                  target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
                  save_dtype: torch.dtype = torch.float32, progress: bool = True, dflash2: dict | None = None) -> dict:
    """Train a drafter on in-memory token sequences (greedy outputs of the target after a prompt of
    `prompt_lens[i]` tokens; default 0) with a fixed number of steps on the CPU: the small path the
    tests and the tiny default pair use. Writes a z-lab checkpoint to `out_dir`; returns the log."""
    if not sequences:
        raise core.TrainingDataError("sequences is empty")
    prompt_lens = [0] * len(sequences) if prompt_lens is None else list(prompt_lens)
    if len(prompt_lens) != len(sequences):
        raise core.TrainingDataError(f"{len(prompt_lens)} prompt_lens for {len(sequences)} sequences")
    rows = [Response(f"seq{i}", "memory", np.asarray(s[:n], dtype=np.int64), np.asarray(s[n:], dtype=np.int64),
                     "length", "greedy") for i, (s, n) in enumerate(zip(sequences, prompt_lens))]
    cfg = TrainConfig(num_layers=num_layers, block_size=block_size, target_layer_ids=tuple(target_layer_ids)
                      if target_layer_ids is not None else None, num_feature_layers=max(1, num_layers),
                      mask_token_id=mask_token_id, max_anchors=num_anchors,
                      tokens_per_batch=batch_size * max(len(s) for s in sequences), steps=steps, lr=lr,
                      trim_loops=False, holdout=0, save_every_s=float("inf"), seed=seed, dflash2=dflash2)
    train(target_dir, rows, out_dir, cfg, device="cpu", progress=progress, save_dtype=save_dtype)
    return json.loads((Path(out_dir) / "train_log.json").read_text())
