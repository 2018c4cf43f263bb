"""Training batches from kept responses: sequences (loops cut), length-bucketed batches, and the
blocks of every anchor with the target's greedy labels."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sgl_dflash.tools.train.responses import Response


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


def conversation_id(prompt_id: str) -> str:
    """The conversation a prompt belongs to: a follow-up "<id>/turn2" belongs to "<id>"."""
    return re.sub(r"/turn\d+$", "", prompt_id)


def split_holdout(rows: Sequence[Response], holdout: int) -> tuple[list[Response], list[Response]]:
    """(train, held out): the held-out rows are greedy first-turn rows picked by a hash of their id,
    so the split does not move when shards or follow-up turns are added."""
    def key(row: Response) -> str:
        return hashlib.sha1(row.id.encode()).hexdigest()

    greedy = sorted((r for r in rows if r.greedy and conversation_id(r.id) == r.id), key=key)
    held = {r.id for r in greedy[:holdout]}
    # Other responses to a held-out prompt (sampled ones, later turns that show its answer) stay
    # out of training too.
    return [r for r in rows if conversation_id(r.id) not in held], greedy[:holdout]


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


def device_batch(seqs: Sequence[TrainSequence], device: torch.device) -> torch.Tensor:
    width = max(len(s.tokens) for s in seqs)
    tokens = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s.tokens)] = s.tokens
    return torch.as_tensor(tokens, device=device)
