"""bench_prefill: both layouts of every batch timed in one run, their outputs compared."""

import json

import pytest

from sgl_dflash.tools import bench_prefill, model_import
from tests.tiny_checkpoints import make_tiny_target


def test_rows_json_and_plot(tmp_path, monkeypatch):
    target = make_tiny_target(tmp_path / "target", "llama")
    out = tmp_path / "prefill.json"
    # Without --model-path it serves the default model (here: the tiny target in its place).
    monkeypatch.setattr(model_import, "ensure_default_model", lambda: target)
    report = bench_prefill.main(["--repeats", "2", "--cases", "200,20,17,23", "90,90", "--out", str(out)])
    assert report["model_path"] == str(target)
    saved = json.loads(out.read_text())
    assert saved["rows"] == report["rows"] and (tmp_path / "prefill.png").stat().st_size > 0
    skewed, pair = saved["rows"]
    # 260 tokens: 320 rows (fine) against 512, and tiles of 64 queries against a dense block of 256
    assert (skewed["before_token_rows"], skewed["serving_token_rows"]) == (512, 320)
    assert (skewed["query_block"], skewed["query_tile"]) == (256, 64)
    assert (pair["before_token_rows"], pair["serving_token_rows"], pair["query_tile"]) == (256, 192, 0)
    for row in saved["rows"]:
        assert row["before_ms"] > 0 and row["serving_ms"] > 0
        assert row["speedup"] == pytest.approx(row["before_ms"] / row["serving_ms"])
        assert row["max_logit_diff"] < 1e-4  # the same prefill, two layouts


def test_bad_cases_are_refused(capsys):
    for bad, message in ((["--cases", "10,x"], "comma-separated prompt lengths, got ['10,x']"),
                         (["--cases", "10,0"], "prompt lengths must be >= 1"),
                         (["--repeats", "0"], "--repeats must be >= 1")):
        with pytest.raises(SystemExit):
            bench_prefill.main(bad)
        assert message in capsys.readouterr().err
