"""`DFlashConfig.held_out_acceptance` / `prior_acceptance`: the drafter's measured per-position
acceptance, read from the evaluations recorded in its config.json (the adaptive policy's prior):
training's held-out responses, and unseen benchmark prompts (tools/unseen_acceptance.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from sgl_dflash.tools.demo import DEFAULT_DRAFTER
from torchax_proposer.config import DFlashConfig


@pytest.fixture(scope="module")
def shipped() -> DFlashConfig:
    return DFlashConfig.from_pretrained(DEFAULT_DRAFTER)


def test_the_shipped_drafters_acceptance_per_position(shipped):
    held_out = shipped.raw["training"]["held_out"]
    for block in (4, 8):  # conditional passes whose running product is the measured rate
        passed = shipped.held_out_acceptance(block)
        assert passed.shape == (block - 1,) and np.all((passed > 0) & (passed < 1))
        np.testing.assert_allclose(np.cumprod(passed), held_out[f"B{block}"]["accept_rate_per_position"], rtol=1e-12)
    # A larger block than measured: the largest measured one, then drafts never counted on.
    np.testing.assert_array_equal(shipped.held_out_acceptance(16), np.pad(shipped.held_out_acceptance(8), (0, 8)))
    np.testing.assert_array_equal(shipped.held_out_acceptance(6), np.pad(shipped.held_out_acceptance(4), (0, 2)))
    assert shipped.held_out_acceptance(2) is None  # nothing measured at or below 2
    # Keys other than B<block> are not blocks.
    other = with_training(shipped, lambda raw: raw["training"]["held_out"].update(X16={"tau": 2.0}, B16x={}))
    np.testing.assert_array_equal(other.held_out_acceptance(16), shipped.held_out_acceptance(16))


def with_training(shipped: DFlashConfig, edit) -> DFlashConfig:
    raw = copy.deepcopy(shipped.raw)
    edit(raw)
    return DFlashConfig.from_dict(raw)


@pytest.mark.parametrize("edit", [
    lambda raw: raw.pop("training"),  # a z-lab checkpoint
    lambda raw: raw["training"].pop("held_out"),
    lambda raw: raw["training"]["held_out"]["B8"].update(accept_rate_per_position=[0.8, 0.6]),  # too short
    lambda raw: raw["training"]["held_out"]["B8"].update(accept_rate_per_position=[0.5, 0.6, 0.4, 0.3, 0.2, 0.1, 0.0]),
    lambda raw: raw["training"]["held_out"]["B8"].update(accept_rate_per_position=[1.5] + [0.1] * 6),
    lambda raw: raw["training"]["held_out"]["B8"].update(accept_rate_per_position="high"),
    lambda raw: raw["training"]["held_out"].update(B8=None),
    lambda raw: raw["training"].update(held_out=[0.8]),
], ids=["no-training", "no-held-out", "wrong-length", "rising", "above-one", "not-numbers", "entry-null", "not-a-dict"])
def test_no_usable_record_gives_none(shipped, edit):
    config = with_training(shipped, edit)
    assert config.held_out_acceptance(8) is None


def test_a_zero_rate_gives_zero_after_it(shipped):
    config = with_training(shipped, lambda raw: raw["training"]["held_out"]["B8"].update(
        accept_rate_per_position=[0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0]))
    np.testing.assert_array_equal(config.held_out_acceptance(8), [0.5, 0.5, 0, 0, 0, 0, 0])


def test_the_prior_prefers_acceptance_on_unseen_prompts(shipped):
    """`prior_acceptance`: `training.unseen` (benchmark prompts the drafter never trained on,
    written by sgl_dflash.tools.unseen_acceptance) where recorded, read as `held_out` is read;
    else the held-out responses' acceptance."""
    # The shipped drafter's record: its acceptance on unseen prompts is below its held-out one.
    unseen = shipped.raw["training"]["unseen"]["B8"]["accept_rate_per_position"]
    np.testing.assert_allclose(np.cumprod(shipped.prior_acceptance(8)), unseen, rtol=1e-12)
    assert np.all(np.asarray(unseen) < shipped.raw["training"]["held_out"]["B8"]["accept_rate_per_position"])
    rates = [0.6, 0.3, 0.15, 0.0, 0.0, 0.0, 0.0]
    config = with_training(shipped, lambda raw: raw["training"].update(unseen={"B8": {"accept_rate_per_position": rates}}))
    np.testing.assert_allclose(config.prior_acceptance(8), [0.6, 0.5, 0.5, 0, 0, 0, 0])
    np.testing.assert_array_equal(config.prior_acceptance(16), np.pad(config.prior_acceptance(8), (0, 8)))
    np.testing.assert_array_equal(config.held_out_acceptance(8), shipped.held_out_acceptance(8))  # untouched
    only_held_out = with_training(shipped, lambda raw: raw["training"].pop("unseen", None))
    np.testing.assert_array_equal(only_held_out.prior_acceptance(8), shipped.held_out_acceptance(8))
    rising = with_training(shipped, lambda raw: raw["training"].update(unseen={"B8": {"accept_rate_per_position": [0.1, 0.5]}}))
    np.testing.assert_array_equal(rising.prior_acceptance(8), shipped.held_out_acceptance(8))  # unusable: held-out
