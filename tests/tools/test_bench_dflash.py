"""bench_dflash --roofline: the engine's decode steps beside a roofline measured in the same run."""

import json

import pytest

from sgl_dflash.tools import bench_dflash
from sgl_dflash.tools.tiny_pair import ensure_tiny_pair
from tests.tools.test_tiny_pair import MINI

pytestmark = pytest.mark.slow  # builds a pair and three engines: not in the fast lane


def test_roofline_rows_json_and_plot(tmp_path):
    pair = ensure_tiny_pair(tmp_path / "pair", MINI, progress=False)
    out = tmp_path / "bench.json"
    report = bench_dflash.main(["--model-path", pair.target_dir, "--draft-path", pair.draft_dir, "--block-sizes", "4",
                                "--batch-sizes", "1", "2", "--max-new-tokens", "6", "--context-length", "128",
                                "--adaptive-bound", "4", "--roofline", "--dtype", "float32", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["results"] == report["results"] and saved["dtype"] == "float32"
    assert (tmp_path / "bench.png").stat().st_size > 0
    machine = saved["roofline_machine"]
    assert len(machine["readings"]) == 2  # before and after the engines ran
    assert machine["read_bandwidth_gbs"] == max(m["read_bandwidth_gbs"] for m in machine["readings"])
    rows = {(r["config"], r["batch_size"]): r for r in saved["results"]}
    assert set(rows) == {(c, b) for c in ("NONE", "DFLASH-b4", "DFLASH-adaptive") for b in (1, 2)}
    for batch in (1, 2):  # adaptive: exact, what it verified, and no one roofline (its steps vary)
        adaptive = rows.pop(("DFLASH-adaptive", batch))
        assert adaptive["identical_to_none"] and "roofline_ms" not in adaptive
        assert 0 <= adaptive["mean_verify_len"] <= 3 and 0 <= adaptive["no_spec_fraction"] <= 1
    for row in rows.values():
        assert row["identical_to_none"]
        assert row["warm_tokens_per_s"] >= row["tokens_per_s"] and row["compiling_steps"] >= 0
        if not row["compiling_steps"]:
            assert row["compile_s"] == 0 and row["warm_tokens_per_s"] == row["tokens_per_s"]
        assert row["roofline_ms"] > 0 and row["decode_tokens_per_s"] > 0 and row["context"] > 0
        assert row["step_over_roofline"] == pytest.approx(row["decode_step_ms"] / row["roofline_ms"], rel=0.01)
    # A DFLASH step reads the drafter's weights besides the target's: a higher floor than a
    # plain step of the same batch, and its ceiling counts tau tokens per request.
    for batch in (1, 2):
        plain, spec = rows[("NONE", batch)], rows[("DFLASH-b4", batch)]
        assert spec["roofline_ms"] > plain["roofline_ms"]
        assert spec["roofline_tokens_per_s"] == pytest.approx(batch * spec["tau"] / spec["roofline_ms"] * 1e3, rel=0.01)


def test_batch_sizes_need_enough_prompts(tmp_path):
    with pytest.raises(SystemExit):
        bench_dflash.main(["--model-path", str(tmp_path), "--draft-path", str(tmp_path), "--block-sizes", "4",
                           "--batch-sizes", "8", "--out", str(tmp_path / "b.json")])


def test_dtype_must_be_one_the_engine_serves(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_dflash.main(["--model-path", str(tmp_path), "--draft-path", str(tmp_path), "--dtype", "float16",
                           "--out", str(tmp_path / "b.json")])
    assert "--dtype: invalid choice: 'float16'" in capsys.readouterr().err
