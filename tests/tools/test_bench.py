"""sgl_dflash.bench on tiny models: metrics helpers, then one small end-to-end run (JSON keys,
plots, exactness counted against the NONE run, the z-lab reference comparison)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sgl_dflash.tools import bench, datasets
from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)


def test_count_exact_counts_identical_outputs_only():
    assert bench.count_exact([[1, 2], [3], [4, 5]], [[1, 2], [3, 0], [4, 5]]) == 2
    assert bench.count_exact([[1, 2]], [[1, 2, 3]]) == 0
    with pytest.raises(bench.BenchError, match="compare"):
        bench.count_exact([[1]], [])


def test_acceptance_stats_from_histograms():
    # Block 4 (3 drafts): cycles accepting 0, 3, 1, 3 drafts.
    stats = bench.acceptance_stats([[1, 1, 0, 1], [0, 0, 0, 1]])
    assert stats["cycles"] == 4
    assert stats["tau"] == pytest.approx(1 + (0 + 3 + 1 + 3) / 4)
    assert stats["per_position"] == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert stats["c_curve"] == pytest.approx([1, 1.75, 2.25, 2.75])
    assert stats["c_curve"][-1] == pytest.approx(stats["tau"])


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from sgl_dflash.tools.tiny_pair import train_tokenizer

    root = tmp_path_factory.mktemp("bench")
    texts = [f"question {i}: what is {i} plus {i}? answer {2 * i}" for i in range(200)]
    target_dir = root / "target"
    tok = train_tokenizer(texts, 300, target_dir)
    make_tiny_target(target_dir, "llama", vocab_size=len(tok), hidden_size=64, num_hidden_layers=2,
                     max_position_embeddings=512)
    tok.save_pretrained(target_dir)  # save_pretrained of the model must not drop the tokenizer
    draft_dir = make_tiny_draft(root / "draft", target_dir, num_layers=1, block_size=4)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?"}) + "\n" for i in range(3)))
    return target_dir, draft_dir, prompts, root


def test_bench_end_to_end_on_tiny_models(tiny_pair):
    target_dir, draft_dir, prompts, root = tiny_pair
    out = root / "out"
    results = bench.main(["--model-path", str(target_dir), "--draft-model-path", str(draft_dir), "--datasets",
                          "--prompts-file", str(prompts), "--num-prompts", "2", "--max-new-tokens", "12",
                          "--block-sizes", "4", "--peer-prompts", "1", "--out", str(out)])
    saved = json.loads((out / "bench.json").read_text())
    assert saved["block_sizes"] == [4]
    row = saved["datasets"]["prompts"]
    assert row["num_prompts"] == 2 and row["none"]["tokens"] > 0
    for block in ("4",):
        r = row["dflash"][block]
        assert set(r) >= {"tau", "per_position", "c_curve", "tokens_per_s", "speedup", "exact", "histogram"}
        assert len(r["per_position"]) == int(block) - 1
        assert 1.0 <= r["tau"] <= int(block)
        # Greedy DFLASH must reproduce NONE exactly, whatever the (random) drafter proposes.
        assert r["exact"] == 2
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / row["none"]["tokens_per_s"])
    peer = saved["peer"]
    assert peer["block_size"] == 4 and peer["num_prompts"] == 1
    assert peer["exact_vs_reference"] == 1
    assert np.isfinite(peer["tokens_per_s_ratio"])
    assert saved["summary"]["best_block_size"] == 4
    for name in ("acceptance_per_position.png", "speedup.png", "c_curve.png"):
        assert (out / name).stat().st_size > 1000
    assert results["summary"] == saved["summary"]


def test_bench_rejects_bad_arguments(tiny_pair, tmp_path):
    target_dir, draft_dir, prompts, _ = tiny_pair
    common = ["--model-path", str(target_dir), "--draft-model-path", str(draft_dir), "--out", str(tmp_path)]
    with pytest.raises(bench.BenchError, match="--datasets"):
        bench.main(common + ["--datasets", "nope"])
    with pytest.raises(bench.BenchError, match="--block-sizes"):
        bench.main(common + ["--block-sizes", "1"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(datasets.DatasetError, match="prompt"):
        bench.main(common + ["--datasets", "--prompts-file", str(bad)])
