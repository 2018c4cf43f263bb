"""sgl_dflash.tools.unseen_acceptance: a drafter's acceptance per position on prompts it never
trained on, read from a fixed-block engine's own histogram and recorded as the adaptive
policy's prior."""

import json
import shutil

import numpy as np
import pytest

from sgl_dflash.tools import unseen_acceptance
from torchax_proposer.config import DFlashConfig


def test_rates_from_a_histogram_of_accepted_drafts():
    # 4 steps: one accepted 0 drafts, one 1, two 3 -> at least 1: 3/4, at least 2: 2/4, at least 3: 2/4
    np.testing.assert_allclose(unseen_acceptance.rates_from_histogram([1, 1, 0, 2]), [0.75, 0.5, 0.5])
    for bad in ([], [3], [0, 0], [[1, 2]]):
        with pytest.raises(ValueError, match="histogram"):
            unseen_acceptance.rates_from_histogram(bad)


def test_end_rows_take_each_sources_last_rows_in_mixed_proportions():
    from sgl_dflash.tools import datasets

    prompts = unseen_acceptance.end_rows(10)  # gsm8k, mt-bench, math500, mt-bench in turn
    assert {k: len(v) for k, v in prompts.items()} == {"gsm8k": 3, "mt-bench": 5, "math500": 2}
    assert prompts["mt-bench"] == [r["prompt"] for r in datasets.load_benchmark("mt-bench")[-5:]]


def test_measured_rates_are_the_engines_accepted_drafts_and_become_the_prior(dflash_engine, trained_draft_dir, tmp_path):
    engine = dflash_engine(8)
    rng = np.random.default_rng(3)
    prompts = {name: [rng.integers(0, 16, int(n)).tolist() for n in rng.integers(3, 20, 3)] for name in ("a", "b")}
    stats = engine.scheduler.stats
    before = {k: stats[k] for k in ("spec_num_correct_drafts", "spec_verify_ct")}
    measured = unseen_acceptance.measure(engine, prompts, max_new_tokens=24)
    correct, steps = (stats[k] - before[k] for k in before)
    pooled = measured["all"]
    assert pooled["steps"] == steps == measured["a"]["steps"] + measured["b"]["steps"] and pooled["prompts"] == 6
    rates = np.asarray(pooled["accept_rate_per_position"])
    assert rates.shape == (7,) and np.all(np.diff(rates) <= 0) and rates[0] > 0  # this drafter gets drafts right
    assert rates.sum() * steps == pytest.approx(correct, abs=1e-3 * steps)  # sum_i P(accepted >= i) = mean accepted
    assert pooled["tau"] == pytest.approx(1 + rates.sum())

    draft_dir = tmp_path / "drafter"
    shutil.copytree(trained_draft_dir, draft_dir)
    unseen_acceptance.write_prior(draft_dir, 8, measured, {"sources": "test"})
    written = json.loads((draft_dir / "config.json").read_text())["training"]["unseen"]["B8"]
    assert written["steps"] == steps and written["how"] == {"sources": "test"}
    config = DFlashConfig.from_pretrained(draft_dir)
    np.testing.assert_allclose(np.cumprod(config.prior_acceptance(8)), rates, atol=1e-12)
