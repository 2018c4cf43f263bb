"""Grow the kept response set with OUR engine, and check outside responses against it.

    regenerate(target, set_dir, prompts)   the target's responses to prompts not yet in the set,
                                           appended one shard per `shard_size` finished prompts
                                           (resumable: an interrupted run loses at most one shard's
                                           work)
    followup_prompts(set, ...)             multi-turn chats: the earlier turns, the target's own
                                           greedy answers to them from the set, and the
                                           conversation's next human turn
    verify(target, set_dir, num=16)        re-generates a random sample of greedy rows with our
                                           Engine and counts those identical over their first
                                           `tokens` tokens (the check before trusting imported rows)
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from sgl_dflash.tools.train.responses import ResponseSet, ResponseSetError, target_identity


def chat_prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a chat (one user turn, or a list of messages) with the generation prompt appended."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
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
        raise ResponseSetError(f"mix names unknown sources {sorted(unknown)}; have {sorted(by_source)}")
    total = sum(mix.values())
    picked = []
    for source, share in mix.items():
        pool = list(by_source[source])
        rng.shuffle(pool)
        picked += pool[: int(round(num * share / total))]
    rng.shuffle(picked)
    return picked


def followup_prompts(responses: ResponseSet, first_turns: Sequence[dict], followups: Sequence[dict],
                     tokenizer) -> list[dict]:
    """Rows {"id", "source", "prompt": [messages]} for every follow-up whose earlier turns all have
    greedy answers in the set that ended on their own (a cut-off answer is not a conversation to
    continue). Each assistant turn is that answer decoded, as a chat client would send it back."""
    chats = {r["id"]: [{"role": "user", "content": r["prompt"]}] for r in first_turns}
    answers = {r.id: r for r in responses.rows if r.greedy and r.finish == "stop"}
    rows = []
    for f in followups:  # each after the turn it follows
        answer, before = answers.get(f["base_id"]), chats.get(f["base_id"])
        if answer is None or before is None:
            continue
        chats[f["id"]] = before + [
            {"role": "assistant", "content": tokenizer.decode(answer.output_ids, skip_special_tokens=True)},
            {"role": "user", "content": f["prompt"]}]
        rows.append({"id": f["id"], "source": f["source"], "prompt": chats[f["id"]]})
    return rows


def sampling_name(temperature: float, top_p: float) -> str:
    return "greedy" if temperature == 0 else f"temperature {temperature:g}, top_p {top_p:g}"


def _engine(target_dir, batch_size: int, max_len: int, seed: int):
    from sgl_dflash.entrypoints.engine import Engine

    return Engine(model_path=str(target_dir), skip_tokenizer_init=True, max_running_requests=batch_size,
                  context_length=max_len, max_total_tokens=batch_size * max_len, random_seed=seed)


def regenerate(target_dir: str | os.PathLike, set_dir: str | os.PathLike, prompts: Sequence[dict], *,
               max_new_tokens: int = 512, max_prompt_tokens: int = 384, batch_size: int = 32,
               shard_size: int = 256, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> ResponseSet:
    """Append the target's responses to `prompts` ({"id", "prompt", "source"}; "prompt" is a text or
    a list of chat messages) that the set does not hold yet, shortest prompts first (similar lengths
    decode together). Prompts longer than `max_prompt_tokens` (chat template applied) are skipped."""
    from transformers import AutoTokenizer

    responses = ResponseSet.open(set_dir, target_identity(target_dir))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    sampling = sampling_name(temperature, top_p)
    todo = []
    for row in prompts:
        if responses.has(row["id"], sampling):
            continue
        ids = chat_prompt_ids(tokenizer, row["prompt"])
        if len(ids) <= max_prompt_tokens:
            todo.append((row, ids))
    todo.sort(key=lambda item: len(item[1]))
    if not todo:
        return responses
    engine = _engine(target_dir, batch_size, max_prompt_tokens + max_new_tokens + 1, seed)
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
    generated_by = f"sgl_dflash.Engine, float32, max_new_tokens {max_new_tokens}, seed {seed}"
    bar = tqdm(total=len(todo), desc="regenerate", unit="prompt")
    done, tokens = [], 0
    # Every prompt queued at once keeps the batch full to the end (a shard per generate call would
    # drain the batch to its longest answers); a shard is written whenever `shard_size` are done,
    # and on the way out of an interrupted run (Ctrl-C) with what has finished so far.
    try:
        for i, out in engine.generate_as_completed(input_ids=[ids for _, ids in todo], sampling_params=params):
            row, ids = todo[i]
            done.append({"id": row["id"], "source": row["source"], "prompt_ids": ids,
                         "output_ids": [int(t) for t in out["output_ids"]],
                         "finish": out["meta_info"]["finish_reason"]["type"]})
            tokens += len(done[-1]["output_ids"])
            bar.update()
            bar.set_postfix(tokens=tokens, refresh=False)
            if len(done) >= shard_size:
                responses.append(done, sampling=sampling, generated_by=generated_by)
                done = []
    finally:
        if done:
            responses.append(done, sampling=sampling, generated_by=generated_by)
    bar.close()
    engine.shutdown()
    return responses


def verify(target_dir: str | os.PathLike, set_dir: str | os.PathLike, *, num: int = 16, tokens: int = 160,
           seed: int = 0, batch_size: int = 16) -> dict:
    """Re-generate `num` random greedy rows of the set with our Engine; compare the first `tokens`."""
    responses = ResponseSet.load(set_dir, sampling="greedy")
    if len(responses) == 0:
        return {"checked": 0, "identical": 0}
    rng = np.random.default_rng(seed)
    picked = [responses.rows[i] for i in rng.choice(len(responses), size=min(num, len(responses)), replace=False)]
    longest = max(len(r.prompt_ids) for r in picked)
    engine = _engine(target_dir, batch_size, longest + tokens + 1, seed)
    outs = engine.generate(input_ids=[r.prompt_ids.tolist() for r in picked],
                           sampling_params={"max_new_tokens": tokens, "temperature": 0})
    engine.shutdown()
    mismatches = []
    for row, out in zip(picked, outs):
        n = min(tokens, len(row.output_ids))
        ours = np.asarray(out["output_ids"][:n])
        if len(ours) != n or not np.array_equal(ours, row.output_ids[:n]):
            first = next((k for k in range(min(len(ours), n)) if ours[k] != row.output_ids[k]), min(len(ours), n))
            mismatches.append({"id": row.id, "first_difference": int(first)})
    return {"checked": len(picked), "identical": len(picked) - len(mismatches), "tokens": tokens,
            "mismatches": mismatches, "set": str(Path(set_dir))}
