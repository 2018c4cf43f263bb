"""Drafter training on real data, in three resumable stages (each appends or checkpoints as it goes):

1. regenerate: training prompts (never benchmark prompts; see sgl_dflash.datasets) go through the
   target's chat template and OUR `Engine` (greedy by default, batched); responses are appended
   to `responses.jsonl` as token ids. Rerunning skips prompts already answered.
2. features: the frozen target (transformers, fp32) runs each prompt+response once; the outputs of
   the drafter's `target_layer_ids` are stored as float16 shards (`features/shard_00000.safetensors, …`).
3. train: random anchors in the response part (resampled every time a sequence is drawn), the
   decay-weighted block loss of `core.dflash_loss`, AdamW + cosine; `state.pt` (model, optimizer,
   step, RNG states) every `--save-every` steps; the final z-lab checkpoint goes to `--out`.

The stages share a work directory (default cache/train/<target name>/).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from sgl_dflash.train import core


# ----------------------------------------------------------------------------------------------
# 1. Regenerate responses with the target
# ----------------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a one-turn chat with the generation prompt appended."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def mix_prompts(rows: list[dict], num: int, mix: dict[str, float], seed: int) -> list[dict]:
    """`num` prompts drawn per source in proportion `mix` (deterministic order for a seed)."""
    rng = random.Random(seed)
    by_source: dict[str, list[dict]] = {}
    for row in rows:
        by_source.setdefault(row["source"], []).append(row)
    unknown = set(mix) - set(by_source)
    if unknown:
        raise core.TrainingDataError(f"mix names unknown sources {sorted(unknown)}; have {sorted(by_source)}")
    total = sum(mix.values())
    picked = []
    for source, share in mix.items():
        pool = list(by_source[source])
        rng.shuffle(pool)
        picked += pool[: int(round(num * share / total))]
    rng.shuffle(picked)
    return picked


def _done_ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    done = set()
    with path.open() as f:
        for line in f:
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError):
                continue  # a line cut by an interrupted write
    return done


def regenerate(
    target_dir: str | os.PathLike,
    work_dir: str | os.PathLike,
    prompts: list[dict],
    *,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    batch_size: int = 16,
    temperature: float = 0.0,
    seed: int = 0,
) -> Path:
    """Append the target's responses for `prompts` to `<work_dir>/responses.jsonl` (resumable)."""
    from transformers import AutoTokenizer

    from sgl_dflash.engine import Engine

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    out_path = work_dir / "responses.jsonl"
    done = _done_ids(out_path)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    todo = []
    for row in prompts:
        if row["id"] in done:
            continue
        ids = chat_prompt_ids(tokenizer, row["prompt"])
        if len(ids) <= max_prompt_tokens:
            todo.append((row, ids))
    if not todo:
        return out_path
    engine = Engine(model_path=str(target_dir), skip_tokenizer_init=True, max_running_requests=batch_size,
                    max_total_tokens=batch_size * (max_prompt_tokens + max_new_tokens + 16),
                    random_seed=seed)
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    bar = tqdm(total=len(todo), desc="regenerate", unit="prompt")
    tokens, start = 0, time.perf_counter()
    with out_path.open("a") as f:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            outs = engine.generate(input_ids=[ids for _, ids in chunk], sampling_params=params)
            for (row, ids), out in zip(chunk, outs):
                f.write(json.dumps({"id": row["id"], "source": row["source"], "prompt_ids": ids,
                                    "output_ids": [int(t) for t in out["output_ids"]]}) + "\n")
                tokens += len(out["output_ids"])
            f.flush()
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    bar.close()
    engine.shutdown()
    return out_path


def regenerate_with_features(
    target_dir: str | os.PathLike,
    work_dir: str | os.PathLike,
    prompts: list[dict],
    layer_ids: Sequence[int],
    *,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    batch_size: int = 8,
    temperature: float = 0.0,
    seed: int = 0,
    num_threads: int | None = None,
) -> Path:
    """Stages 1+2 in one pass with transformers (the cheaper path on a CPU): greedy `generate` with
    `output_hidden_states` yields the responses AND the aux features of every token but the last
    (which no anchor ever sees as context), so the target runs once per token instead of twice.

    Appends to `responses.jsonl` and writes one feature shard per batch (resumable per batch).
    """
    from transformers import AutoTokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    work_dir = Path(work_dir)
    feat_dir = work_dir / "features"
    feat_dir.mkdir(parents=True, exist_ok=True)
    meta = {"layer_ids": [int(i) for i in layer_ids], "format": "fused"}
    meta_path = feat_dir / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise core.TrainingDataError(f"{feat_dir} holds features for {meta_path.read_text()}; use a new work dir")
    meta_path.write_text(json.dumps(meta))
    out_path = work_dir / "responses.jsonl"
    done = _done_ids(out_path)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    todo = [(row, ids) for row in prompts if row["id"] not in done
            for ids in [chat_prompt_ids(tokenizer, row["prompt"])] if len(ids) <= max_prompt_tokens]
    # Similar lengths in a batch waste less compute on padding; keep the source mix per window.
    window = batch_size * 8
    todo = [x for i in range(0, len(todo), window) for x in sorted(todo[i : i + window], key=lambda x: len(x[1]))]
    target = core.load_frozen_target(target_dir)
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = next(iter(eos_ids))
    shard_index = len(list(feat_dir.glob("shard_*.safetensors")))
    bar = tqdm(total=len(todo), desc="regenerate+features", unit="prompt")
    tokens, start = 0, time.perf_counter()
    torch.manual_seed(seed)
    with out_path.open("a") as f:
        for i in range(0, len(todo), batch_size):
            chunk = todo[i : i + batch_size]
            width = max(len(ids) for _, ids in chunk)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in chunk])
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in chunk])
            with torch.no_grad():
                out = target.generate(input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                      do_sample=temperature > 0, temperature=temperature or None, top_p=None,
                                      top_k=None, pad_token_id=pad, output_hidden_states=True,
                                      return_dict_in_generate=True)
            # hidden_states[step][layer]: step 0 covers the prompt, later steps one token each.
            per_layer = [torch.cat([step[l + 1] for step in out.hidden_states], dim=1) for l in layer_ids]
            feats_all = torch.cat(per_layer, dim=-1)  # [batch, width + generated - 1, n_aux*H]
            tensors = {}
            for j, (row, ids) in enumerate(chunk):
                gen = out.sequences[j, width:].tolist()
                stop = next((k + 1 for k, t in enumerate(gen) if t in eos_ids), len(gen))
                gen = gen[:stop]
                seq = torch.tensor(ids + gen, dtype=torch.int64)
                offset = width - len(ids)
                feats = torch.zeros(len(seq), feats_all.shape[-1], dtype=torch.float16)
                feats[: len(seq) - 1] = feats_all[j, offset : offset + len(seq) - 1].to(torch.float16)
                mask = torch.zeros(len(seq), dtype=torch.bool)
                mask[len(ids):] = True
                tensors.update({f"tokens_{j}": seq, f"mask_{j}": mask, f"features_{j}": feats})
                tokens += len(gen)
            path = feat_dir / f"shard_{shard_index:05d}.safetensors"
            save_file(tensors, str(path.with_suffix(".tmp")))
            path.with_suffix(".tmp").replace(path)
            shard_index += 1
            for j, (row, ids) in enumerate(chunk):
                gen = tensors[f"tokens_{j}"][len(ids):].tolist()
                f.write(json.dumps({"id": row["id"], "source": row["source"], "prompt_ids": ids,
                                    "output_ids": gen}) + "\n")
            f.flush()
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    bar.close()
    return out_path


def read_responses(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the last line of an interrupted run
    return rows


# ----------------------------------------------------------------------------------------------
# 2. Target features, cached on disk
# ----------------------------------------------------------------------------------------------


def compute_features(
    target_dir: str | os.PathLike,
    work_dir: str | os.PathLike,
    layer_ids: Sequence[int],
    *,
    shard_size: int = 64,
) -> Path:
    """Write float16 aux features of every response sequence into shards (resumable per shard).

    Shard k holds sequences `k*shard_size ..` of responses.jsonl, keys `tokens_i`, `mask_i`,
    `features_i`. `mask` marks the response tokens (the supervised part).
    """
    work_dir = Path(work_dir)
    rows = read_responses(work_dir / "responses.jsonl")
    feat_dir = work_dir / "features"
    feat_dir.mkdir(exist_ok=True)
    meta_path = feat_dir / "meta.json"
    meta = {"layer_ids": [int(i) for i in layer_ids], "shard_size": shard_size}
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise core.TrainingDataError(f"{feat_dir} holds features for {meta_path.read_text()}; use a new work dir")
    meta_path.write_text(json.dumps(meta))
    target = core.load_frozen_target(target_dir)
    num_full = len(rows) // shard_size  # only complete shards: later runs may add rows
    for k in tqdm(range(num_full), desc="features", unit="shard"):
        path = feat_dir / f"shard_{k:05d}.safetensors"
        if path.is_file():
            continue
        tensors = {}
        for i, row in enumerate(rows[k * shard_size : (k + 1) * shard_size]):
            tokens = torch.tensor(row["prompt_ids"] + row["output_ids"], dtype=torch.int64)
            feats = core.target_features(target, tokens[None], layer_ids)[0]
            if not torch.isfinite(feats.to(torch.float16)).all():
                raise core.TrainingDataError(f"features of {row['id']} overflow float16")
            mask = torch.zeros(len(tokens), dtype=torch.bool)
            mask[len(row["prompt_ids"]):] = True
            tensors[f"tokens_{i}"] = tokens
            tensors[f"mask_{i}"] = mask
            tensors[f"features_{i}"] = feats.to(torch.float16).contiguous()
        save_file(tensors, str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").replace(path)
    return feat_dir


class FeatureStore:
    """All cached shards in memory (float16): a list of (tokens, mask, features) per sequence."""

    def __init__(self, feat_dir: str | os.PathLike):
        self.items: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []
        for path in sorted(Path(feat_dir).glob("shard_*.safetensors")):
            shard = load_file(str(path))
            for i in range(len(shard) // 3):
                self.items.append((shard[f"tokens_{i}"].numpy(), shard[f"mask_{i}"].numpy(), shard[f"features_{i}"]))
        if not self.items:
            raise core.TrainingDataError(f"no feature shards in {feat_dir}; run the features stage first")

    def __len__(self) -> int:
        return len(self.items)


# ----------------------------------------------------------------------------------------------
# 3. Train with resumable checkpoints
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainArgs:
    num_layers: int = 2
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    steps: int = 1000
    batch_size: int = 4
    num_anchors: int = 16
    lr: float = 6e-4
    seed: int = 0
    save_every: int = 50
    init_from: str | None = None  # start from this drafter checkpoint's weights (new optimizer)
    init_layers_from_target: bool = False  # copy the target's last layers into the drafter layers
    holdout: int = 8  # sequences kept out of training to report held-out tau
    sampled_positions: int | None = 5  # loss offsets per step, drawn with p ~ w_k (None: all B-1)
    vocab_negatives: int | None = None  # sampled softmax: used ids + this many others (None: full)
    num_threads: int | None = None


def train(
    target_dir: str | os.PathLike,
    work_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    args: TrainArgs,
    *,
    save_dtype: torch.dtype = torch.bfloat16,
    stop_after: int | None = None,
) -> Path:
    """Train (or resume) the drafter on the cached features; writes the z-lab checkpoint to out_dir.

    `stop_after=n` ends this call after n more steps (state saved), e.g. to fit a time budget.
    """
    work_dir, out_dir = Path(work_dir), Path(out_dir)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    feat_meta = json.loads((work_dir / "features" / "meta.json").read_text())
    layer_ids = list(args.target_layer_ids or feat_meta["layer_ids"])
    if layer_ids != feat_meta["layer_ids"]:
        raise core.TrainingDataError(f"features were computed for layers {feat_meta['layer_ids']}, not {layer_ids}")
    config = core.build_draft_config(target_config, num_layers=args.num_layers, block_size=args.block_size,
                                     target_layer_ids=layer_ids, mask_token_id=args.mask_token_id)
    store = FeatureStore(work_dir / "features")
    num_shards = len(list((work_dir / "features").glob("shard_*.safetensors")))
    train_items, held_out = store.items[args.holdout:], store.items[: args.holdout]
    target = core.load_frozen_target(target_dir)
    embed, lm_head = core.target_embed_and_head(target)
    del target

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    model = core.new_draft_model(config, seed=args.seed).train()
    with torch.no_grad():  # start at the target's output scale: its final norm feeds the same lm_head
        model.norm.weight.copy_(target_final_norm(target_dir))
    if args.init_layers_from_target:
        init_from_target_layers(model, target_dir, layer_ids)
    if args.init_from:
        init = load_file(str(Path(args.init_from) / "model.safetensors"))
        model.load_state_dict({k: v.to(torch.float32) for k, v in init.items()})
    optimizer = core.make_optimizer(model, args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    step, log = 0, []
    out_dir.mkdir(parents=True, exist_ok=True)
    state_path = out_dir / "train_state.pt"  # next to the checkpoint: runs with other outputs don't clash
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        if state["args"] != asdict(args):
            raise core.TrainingDataError(f"{state_path} was written with other arguments: {state['args']}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["numpy_rng"]
        torch.set_rng_state(state["torch_rng"])
        generator.set_state(state["loss_rng"])
        step, log = state["step"], state["log"]
    weights = core.loss_weights(args.block_size)
    vocab = _train_vocab(train_items, target_config["vocab_size"], args.vocab_negatives)

    def save_state() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"args": asdict(args), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "numpy_rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                    "loss_rng": generator.get_state(),
                    "step": step, "log": log}, tmp)
        tmp.replace(state_path)

    bar = tqdm(total=args.steps, initial=step, desc="train drafter", unit="step")
    last = args.steps if stop_after is None else min(args.steps, step + stop_after)
    while step < last:
        pick = rng.choice(len(train_items), size=args.batch_size, replace=False)
        items = [train_items[i] for i in pick]
        batch = core.make_batch([t for t, _, _ in items], [m for _, m, _ in items],
                                [f.to(torch.float32) for _, _, f in items], block_size=args.block_size,
                                num_anchors=args.num_anchors, rng=rng)
        if batch is None:
            continue
        loss, stats = core.dflash_loss(model, embed, lm_head, batch, block_size=args.block_size, weights=weights,
                                       sampled_positions=args.sampled_positions, generator=generator,
                                       vocab=vocab)
        grad_norm = core.optimizer_step(model, optimizer, loss, core.lr_at(step, args.steps, args.lr))
        step += 1
        log.append({"step": step, "loss": stats["loss"], "tau": stats["tau"], "grad_norm": grad_norm})
        bar.update()
        bar.set_postfix(loss=f"{stats['loss']:.3f}")
        if step % args.save_every == 0 or step == last:
            save_state()
            # Shards written since (a regenerate run still going) join the training set here.
            if len(list((work_dir / "features").glob("shard_*.safetensors"))) != num_shards:
                store = FeatureStore(work_dir / "features")
                num_shards = len(list((work_dir / "features").glob("shard_*.safetensors")))
                train_items = store.items[args.holdout:]
                vocab = _train_vocab(train_items, target_config["vocab_size"], args.vocab_negatives)
            _save_output(model, config, out_dir, target_dir, args, store, log, held_out, embed, lm_head,
                         save_dtype)
    bar.close()
    return out_dir


def _train_vocab(items, vocab_size: int, negatives: int | None) -> core.TrainVocab | None:
    """The sampled-softmax support: every response token of the training items (all labels)."""
    if negatives is None:
        return None
    return core.TrainVocab(torch.cat([torch.as_tensor(t[m]) for t, m, _ in items]), vocab_size, negatives)


def init_from_target_layers(model: torch.nn.Module, target_dir: str | os.PathLike, layer_ids: Sequence[int]) -> None:
    """Warm start for tiny data budgets: drafter layer i <- target layer n-L+i (same shapes: the
    drafter mirrors the target's geometry), `fc` reads the deepest captured layer, and
    `hidden_norm` takes the first copied layer's input norm, so context K/V start out as that
    target layer would compute them. q_norm/k_norm (absent in Llama) start at one."""
    from safetensors import safe_open

    config = json.loads((Path(target_dir) / "config.json").read_text())
    n, num = config["num_hidden_layers"], len(model.layers)
    index = Path(target_dir) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors = {}
    for name in files:
        with safe_open(str(Path(target_dir) / name), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.")})
    hidden = config["hidden_size"]
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            src = f"model.layers.{n - num + i}."
            for name, param in layer.named_parameters():
                if src + name in tensors:
                    param.copy_(tensors[src + name].to(param.dtype))
        deepest = int(np.argmax(layer_ids))
        model.fc.weight.zero_()
        model.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden)
        model.hidden_norm.weight.copy_(tensors[f"model.layers.{n - num}.input_layernorm.weight"])


def target_final_norm(target_dir: str | os.PathLike) -> torch.Tensor:
    from safetensors import safe_open

    index = Path(target_dir) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    for name in files:
        with safe_open(str(Path(target_dir) / name), "pt") as f:
            if "model.norm.weight" in f.keys():
                return f.get_tensor("model.norm.weight").to(torch.float32)
    raise core.TrainingDataError(f"{target_dir} has no model.norm.weight")


@torch.no_grad()
def held_out_stats(model, embed, lm_head, items, block_size: int, seed: int = 1234) -> dict:
    """Teacher-forced acceptance on held-out greedy responses: exactly the greedy tau of spec
    decoding at those anchors (the drafter sees the true committed prefix)."""
    if not items:
        return {}
    model.eval()
    rng = np.random.default_rng(seed)
    batch = core.make_batch([t for t, _, _ in items], [m for _, m, _ in items],
                            [f.to(torch.float32) for _, _, f in items], block_size=block_size,
                            num_anchors=8, rng=rng)
    _, stats = core.dflash_loss(model, embed, lm_head, batch, block_size=block_size,
                                weights=core.loss_weights(block_size))
    model.train()
    return {"tau": stats["tau"], "loss": stats["loss"], "acc_per_pos": stats["acc_per_pos"]}


def _save_output(model, config, out_dir, target_dir, args, store, log, held_out, embed, lm_head, save_dtype):
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    recent = log[-50:]
    extra = {
        "target": {"name": Path(target_dir).name, "model_type": target_config.get("model_type"),
                   "num_hidden_layers": target_config["num_hidden_layers"],
                   "hidden_size": target_config["hidden_size"], "vocab_size": target_config["vocab_size"]},
        "training": {**asdict(args), "steps_done": log[-1]["step"] if log else 0,
                     "optimizer": "AdamW(0.9, 0.95, wd 0.01)", "schedule": "cosine, 4% warmup",
                     "grad_clip": 1.0, "loss_gamma": core.loss_gamma(args.block_size),
                     "data": "target-regenerated responses (greedy) to sharegpt/MATH-train/python-stdlib prompts",
                     "num_sequences": len(store), "recent_train_loss": float(np.mean([r["loss"] for r in recent])),
                     "held_out": held_out_stats(model, embed, lm_head, held_out, args.block_size),
                     "date": time.strftime("%Y-%m-%d %H:%M")},
    }
    core.save_draft_checkpoint(model, config, out_dir, dtype=save_dtype, extra=extra)
