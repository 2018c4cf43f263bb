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
from tqdm import tqdm

from sgl_dflash.tools.train import core
from sgl_dflash.tools.train.batches import device_batch, length_batches, make_blocks, split_holdout, to_train_sequence
from sgl_dflash.tools.train.objective import FeatureTarget, autocast, block_loss, evaluate
from sgl_dflash.tools.train.responses import Response, ResponseSet
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
        tokens = device_batch(part, device)
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
        with autocast(device):
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
                        trim_loops: bool = True, device: str | torch.device | None = None,
                        token_map: Sequence[int] | None = None) -> dict:
    """Held-out teacher-forced tau of a saved drafter on the same split `train` holds out
    (drafting over `token_map`'s ids only, when given)."""
    from torchax_proposer import load_draft_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    model = load_draft_model(draft_dir, target_config).to(device)
    _, held_rows = split_holdout(list(data), holdout)
    held = [to_train_sequence(r, trim_loops=trim_loops, max_seq_len=1024) for r in held_rows]
    target = FeatureTarget(target_dir, model.target_layer_ids, device)
    return {f"B{b}": evaluate(model, target, held, b, token_map=token_map) for b in block_sizes}


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
