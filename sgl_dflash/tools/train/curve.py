"""Learning curve of drafter runs: held-out tau against the data a drafter saw, and the training loss
against the tokens it processed, from the runs' own records (config.json + train_log.json).

    python -m sgl_dflash.train curve --runs DIR [DIR ...] --out docs/training/learning_curve

Writes <out>.json (one row per run) and <out>.png. A run is a drafter directory written by
`python -m sgl_dflash.train train`; `--extra FILE.json` adds rows measured otherwise (e.g. an
older drafter evaluated with `python -m sgl_dflash.train eval`), each {"name", "response_tokens",
"held_out": {"B8": {"tau": ...}, ...}, "note"}. A run started `--init-from` another run's directory
"follows" it: its loss curve continues where that one ended (`first_step` in the JSON).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence


def run_row(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    training = json.loads((run_dir / "config.json").read_text())["training"]
    log_path = run_dir / "train_log.json"
    log = json.loads(log_path.read_text())["log"] if log_path.is_file() else []
    init_from = training.get("recipe", {}).get("init_from")
    return {
        "name": run_dir.name,
        "response_tokens": training["data"]["response_tokens"],
        "held_out": {k: {"tau": v["tau"]} for k, v in training.get("held_out", {}).items()},
        "steps": training.get("steps_done"),
        "train_seconds": training.get("train_seconds"),
        "recipe": training.get("recipe", {}),
        "follows": Path(init_from).name if init_from else None,
        "loss_curve": [[r["step"], r["rows"], r["loss"]] for r in log[:: max(1, len(log) // 200)]],
    }


def write_curve(rows: Sequence[dict], out: str | Path) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out.with_suffix(".json"), out.with_suffix(".png")
    rows, ends = [dict(r) for r in rows], {}
    for r in rows:  # a continued run's steps count on from the end of the run it started from
        r["first_step"] = ends.get(r.get("follows"), 0)
        ends[r["name"]] = r["first_step"] + (r.get("steps") or 0)
    json_path.write_text(json.dumps(rows, indent=1) + "\n")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for block in ("B4", "B8"):
        points = sorted((r["response_tokens"], r["held_out"][block]["tau"]) for r in rows if block in r["held_out"])
        if points:
            left.plot(*zip(*points), marker="o", label=f"block size {block[1:]}")
    for r in rows:
        if "B8" in r["held_out"]:
            left.annotate(r["name"], (r["response_tokens"], r["held_out"]["B8"]["tau"]), fontsize=7)
    left.set_xscale("log")
    left.set_xlabel("response tokens in the training set")
    left.set_ylabel("held-out teacher-forced tau")
    left.set_title("acceptance vs data")
    left.legend()
    for r in rows:
        if r.get("loss_curve"):
            steps = [r["first_step"] + step for step, _, _ in r["loss_curve"]]
            right.plot(steps, [loss for _, _, loss in r["loss_curve"]], label=r["name"])
    right.set_yscale("log")
    right.set_xlabel("training step (continued runs count on)")
    right.set_ylabel("training loss")
    right.set_title("training loss")
    if any(r.get("loss_curve") for r in rows):
        right.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path
