"""The kept training set: the target's responses to the training prompts, as token ids in git.

Layout of a response set (one directory per target, e.g. data/SmolLM2-135M-Instruct/):

    manifest.json          target (name, GGUF/weights checksum), one entry per shard (file,
                           responses, response tokens, sources, finish counts, sampling, how it
                           was generated), and the totals
    shard-00000.npz        ids, sources, finish, prompt/output token ids (flat uint16 or uint32
                           arrays + int64 offsets)

Features are never stored: the trainer recomputes them from these tokens with the target's
prefill. `ResponseSet.load(path)` reads everything in one call; `append(rows, ...)` writes a new
shard and never stores a prompt twice for the same sampling (so regeneration can resume and grow
the set).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from sgl_dflash.tools import REPO_ROOT

DATA_DIR = REPO_ROOT / "data"


class ResponseSetError(ValueError):
    """A response set or a row to add is malformed; the message names the file or field."""


@dataclass(frozen=True)
class Response:
    id: str
    source: str
    prompt_ids: np.ndarray  # int64 [prompt_len]
    output_ids: np.ndarray  # int64 [output_len]; ends with EOS when finish == "stop"
    finish: str  # "stop" | "length"
    sampling: str  # the shard's sampling ("greedy" or e.g. "temperature 0.8, top_p 0.95")

    @property
    def greedy(self) -> bool:
        return self.sampling == "greedy"


def default_set_dir(target_name: str) -> Path:
    """Where the kept set of a target lives in the repository: data/<target name>/."""
    return DATA_DIR / target_name


def _flat(seqs: Sequence[Sequence[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    flat = np.zeros(int(offsets[-1]), dtype=dtype)
    for s, a, b in zip(seqs, offsets[:-1], offsets[1:]):
        flat[a:b] = s
    return flat, offsets


class ResponseSet:
    """All shards of one directory, in shard order."""

    def __init__(self, path: str | os.PathLike, manifest: dict, rows: list[Response]):
        self.path = Path(path)
        self.manifest = manifest
        self.rows = rows
        self._keys = {(r.id, r.sampling) for r in rows}

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, *, sampling: str | None = None) -> "ResponseSet":
        """Every response of the set at `path` (optionally only shards with this `sampling`)."""
        path = Path(path)
        manifest_path = path / "manifest.json"
        if not manifest_path.is_file():
            raise ResponseSetError(f"{path} is not a response set (no manifest.json)")
        manifest = json.loads(manifest_path.read_text())
        rows: list[Response] = []
        for shard in manifest.get("shards", []):
            if sampling is not None and shard["sampling"] != sampling:
                continue
            rows += _read_shard(path / shard["file"], shard["sampling"])
        return cls(path, manifest, rows)

    @classmethod
    def create(cls, path: str | os.PathLike, target: dict) -> "ResponseSet":
        """An empty set for `target` ({"name", "checksum", ...}); refuses to overwrite one."""
        path = Path(path)
        if (path / "manifest.json").is_file():
            raise ResponseSetError(f"{path} already holds a response set")
        path.mkdir(parents=True, exist_ok=True)
        manifest = {"format": "sgl-dflash response set v1", "target": target, "shards": [], "totals": {}}
        _write_json(path / "manifest.json", manifest)
        return cls(path, manifest, [])

    @classmethod
    def open(cls, path: str | os.PathLike, target: dict) -> "ResponseSet":
        """The set at `path`, created if missing; its target must match `target["checksum"]`."""
        path = Path(path)
        if not (path / "manifest.json").is_file():
            return cls.create(path, target)
        found = cls.load(path)
        if found.manifest["target"].get("checksum") != target.get("checksum"):
            raise ResponseSetError(
                f"{path} holds responses of target checksum {found.manifest['target'].get('checksum')}, "
                f"not {target.get('checksum')}: use another directory for another target")
        return found

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def has(self, prompt_id: str, sampling: str) -> bool:
        """Whether the set holds a response to `prompt_id` sampled this way."""
        return (prompt_id, sampling) in self._keys

    @property
    def response_tokens(self) -> int:
        return int(sum(len(r.output_ids) for r in self.rows))

    def used_token_ids(self, max_ids: int | None = None) -> list[int]:
        """The drafter's hot-token map (`--speculative-token-map`), sorted: every token id some
        response uses, or only the `max_ids` most frequent ones (ties: the smaller id first)."""
        counts = self.token_counts()
        used = np.flatnonzero(counts)
        if max_ids is not None:
            if max_ids < 1:
                raise ResponseSetError(f"max_ids must be positive, got {max_ids}")
            used = used[np.argsort(-counts[used], kind="stable")[:max_ids]]
        return np.sort(used).tolist()

    def token_counts(self) -> np.ndarray:
        """How often each token id occurs in the responses (int64 [max id + 1])."""
        if not self.rows:
            return np.zeros(0, np.int64)
        return np.bincount(np.concatenate([r.output_ids for r in self.rows]))

    # -- writing ---------------------------------------------------------------------------------
    def append(self, rows: Iterable[dict], *, sampling: str, generated_by: str, source_note: str = "") -> int:
        """Write `rows` ({"id", "source", "prompt_ids", "output_ids", "finish"}) as a new shard.

        A prompt id has at most one response per sampling: rows whose (id, sampling) the set already
        holds, or that repeat within `rows`, are skipped. Returns the number of rows written.
        """
        fresh, seen = [], set()
        for row in rows:
            for key in ("id", "source", "prompt_ids", "output_ids", "finish"):
                if key not in row:
                    raise ResponseSetError(f"row {row.get('id', '?')!r} has no {key!r}")
            if row["finish"] not in ("stop", "length"):
                raise ResponseSetError(f"row {row['id']!r}: finish must be 'stop' or 'length', not {row['finish']!r}")
            if (row["id"], sampling) in self._keys or row["id"] in seen:
                continue
            seen.add(row["id"])
            fresh.append(row)
        if not fresh:
            return 0
        index = len(self.manifest["shards"])
        name = f"shard-{index:05d}.npz"
        vocab_max = max(int(max(r["prompt_ids"] + r["output_ids"] or [0])) for r in fresh)
        dtype = np.uint16 if vocab_max < 2**16 else np.uint32
        prompt_flat, prompt_off = _flat([r["prompt_ids"] for r in fresh], dtype)
        output_flat, output_off = _flat([r["output_ids"] for r in fresh], dtype)
        tmp = self.path / (name + ".tmp.npz")
        np.savez_compressed(tmp, ids=np.array([r["id"] for r in fresh]), sources=np.array([r["source"] for r in fresh]),
                            finish=np.array([r["finish"] for r in fresh]), prompt_tokens=prompt_flat,
                            prompt_offsets=prompt_off, output_tokens=output_flat, output_offsets=output_off)
        tmp.replace(self.path / name)
        entry = {
            "file": name,
            "responses": len(fresh),
            "response_tokens": int(output_off[-1]),
            "prompt_tokens": int(prompt_off[-1]),
            "by_source": _count(r["source"] for r in fresh),
            "finish": _count(r["finish"] for r in fresh),
            "sampling": sampling,
            "generated_by": generated_by,
            "date": time.strftime("%Y-%m-%d"),
        }
        if source_note:
            entry["source_note"] = source_note
        self.manifest["shards"].append(entry)
        self.rows += _read_shard(self.path / name, sampling)
        self._keys |= {(i, sampling) for i in seen}
        self.manifest["totals"] = self._totals()
        _write_json(self.path / "manifest.json", self.manifest)
        return len(fresh)

    def _totals(self) -> dict:
        shards = self.manifest["shards"]
        by_sampling: dict[str, dict] = {}
        for s in shards:
            t = by_sampling.setdefault(s["sampling"], {"responses": 0, "response_tokens": 0})
            t["responses"] += s["responses"]
            t["response_tokens"] += s["response_tokens"]
        return {"shards": len(shards), "responses": sum(s["responses"] for s in shards),
                "response_tokens": sum(s["response_tokens"] for s in shards),
                "by_source": _count(r.source for r in self.rows), "by_sampling": by_sampling}


def _count(values: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return dict(sorted(counts.items()))


def _read_shard(path: Path, sampling: str) -> list[Response]:
    if not path.is_file():
        raise ResponseSetError(f"shard {path} named in the manifest is missing")
    with np.load(path) as z:
        ids, sources, finish = z["ids"], z["sources"], z["finish"]
        pt, po = z["prompt_tokens"].astype(np.int64), z["prompt_offsets"]
        ot, oo = z["output_tokens"].astype(np.int64), z["output_offsets"]
    return [Response(str(ids[i]), str(sources[i]), pt[po[i]:po[i + 1]], ot[oo[i]:oo[i + 1]], str(finish[i]), sampling)
            for i in range(len(ids))]


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def read_jsonl_rows(path: str | os.PathLike) -> list[dict]:
    """Rows of a (optionally gzipped) JSONL file of responses, e.g. ../shared/data/*/greedy.jsonl.gz."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    rows = []
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ResponseSetError(f"{path}:{n}: not valid JSON ({err})") from err
    return rows


def target_identity(target_dir: str | os.PathLike) -> dict:
    """{"name", "checksum"} of an HF target directory: sha256 over its tensors (names and bytes, in
    name order), so two conversions of the same weights agree whatever the file layout."""
    import hashlib

    from safetensors import safe_open

    target_dir = Path(target_dir)
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise ResponseSetError(f"{target_dir} holds no *.safetensors weights")
    tensors = {}
    for path in files:
        with safe_open(str(path), "np") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(tensors[name]).tobytes())
    return {"name": target_dir.name, "checksum": "sha256:" + digest.hexdigest()}
