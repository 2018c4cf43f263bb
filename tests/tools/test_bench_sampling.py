"""sgl_dflash.tools.bench_sampling's transform part on a small vocabulary: every row times the three
transforms on the same logits (after checking the candidate path gives the sorted one's
distribution), the ratio follows the medians, and the JSON and the plot are written."""

import json

from jax_backend import sampling
from sgl_dflash.tools import bench_sampling


def test_transform_rows_and_outputs(tmp_path):
    vocab = sampling.NUM_CANDIDATES * 2
    results = bench_sampling.main(["--rows", "1", "4", "--vocab", str(vocab), "--repeats", "2",
                                   "--engine-batch", "0", "--out", str(tmp_path)])
    rows = results["transform"]
    assert [(r["rows"], r["logits"]) for r in rows] == [(1, "peaked"), (1, "flat"), (4, "peaked"), (4, "flat")]
    for r in rows:
        assert set(r["ms"]) == {"candidates", "sorted", "plain"} and min(r["ms"].values()) > 0
        assert r["sorted/candidates"] == r["ms"]["sorted"] / r["ms"]["candidates"]
    assert json.loads((tmp_path / "sampling.json").read_text())["num_candidates"] == sampling.NUM_CANDIDATES
    assert (tmp_path / "sampling.png").read_bytes()[:4] == b"\x89PNG"
