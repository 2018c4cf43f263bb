"""A DFlash 2 drafter served through `Engine` (DFLASH): greedy gives the same tokens and accepted-draft
histograms as the z-lab reference's `dflash_generate`, and the same tokens as NONE; sampling (the
selector samples its path, rejection sampling against its q over K candidates) gives the target's
own distribution (chi-square, as for DFlash 1 in test_dflash_sampling.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sgl_dflash.entrypoints.engine import Engine
from tests.conftest import DRAFT_LAYER_IDS
from tests.speculative.test_adaptive import flat_costs, random_lengths
from tests.speculative.test_dflash_sampling import NUM_SAMPLES, exact_joint, goodness_of_fit
from tests.tiny_checkpoints import load_hf_model
from tests.tiny_draft import DFLASH2_TINY, make_tiny_draft

pytestmark = pytest.mark.slow  # engines end to end: not in the fast lane


@pytest.fixture(scope="module")
def dflash2_draft_dir(tmp_path_factory, spec_target_dir):
    return str(make_tiny_draft(tmp_path_factory.mktemp("dflash2_draft"), spec_target_dir, num_layers=2, block_size=8,
                               target_layer_ids=DRAFT_LAYER_IDS, dflash2=DFLASH2_TINY, seed=4))


@pytest.fixture(scope="module")
def engine(engine_kwargs, dflash2_draft_dir):
    return Engine(**engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=dflash2_draft_dir)


@pytest.fixture(scope="module")
def trained_dflash2_dir(spec_target_dir, none_engine, tmp_path_factory):
    """A DFlash 2 drafter that accepts (so that rejection sampling is really exercised): trained
    briefly with the selector loss on the target's greedy outputs, like conftest's DFlash 1 one."""
    from sgl_dflash.tools.train import train_drafter

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 16, size=int(rng.integers(3, 12))).tolist() for _ in range(32)]
    outs = none_engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True})
    path = tmp_path_factory.mktemp("trained_dflash2")
    train_drafter(spec_target_dir, path, [p + o["output_ids"] for p, o in zip(prompts, outs)],
                  prompt_lens=[len(p) for p in prompts], block_size=8, steps=40, target_layer_ids=DRAFT_LAYER_IDS,
                  batch_size=8, num_anchors=16, lr=3e-3, progress=False, dflash2=DFLASH2_TINY)
    return str(path)


@pytest.fixture(scope="module")
def trained_engine(engine_kwargs, trained_dflash2_dir):
    return Engine(**engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_dflash2_dir)


def test_engine_greedy_matches_dflash_generate(monkeypatch, engine, spec_target_dir, dflash2_draft_dir,
                                               spec_prompts, none_engine):
    import dflash.model
    from dflash.model import DFlash2DraftModel, dflash_generate

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)  # its stats timer needs CUDA
    block, new_tokens = 8, 40
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    ours = engine.generate(input_ids=spec_prompts, sampling_params=[params] * len(spec_prompts))  # one batch
    none = none_engine.generate(input_ids=spec_prompts, sampling_params=[params] * len(spec_prompts))

    target = load_hf_model(spec_target_dir)
    reference = DFlash2DraftModel.from_pretrained(dflash2_draft_dir, dtype=torch.float32).eval()
    accepted_any = 0
    for prompt, out, base in zip(spec_prompts, ours, none):
        assert out["output_ids"] == base["output_ids"]
        # Extra room so that every reference step we compare with verifies a full block.
        ref = dflash_generate(reference, target, torch.tensor([prompt]), new_tokens + block,
                              stop_token_ids=None, return_stats=True)
        assert out["output_ids"] == ref.output_ids[0, len(prompt):].tolist()[:new_tokens]
        steps = out["meta_info"]["spec_verify_ct"]
        ref_correct = [produced - 1 for produced in ref.acceptance_lengths][:steps]
        assert out["meta_info"]["spec_correct_drafts_histogram"] == np.bincount(ref_correct, minlength=block).tolist()
        accepted_any += sum(ref_correct)
    assert accepted_any >= 5, accepted_any  # drafts were accepted: acceptance is compared too


@pytest.mark.parametrize("config,adaptive", [({"temperature": 1.0}, None), ({"temperature": 0.8, "top_k": 3}, None),
                                             ({"temperature": 1.0}, "policy"), ({"temperature": 1.0}, "random")],
                         ids=["t1", "top_k", "t1_adaptive", "t1_adaptive_random"])
def test_engine_sampling_matches_target_distribution(monkeypatch, config, adaptive, engine_kwargs, trained_dflash2_dir,
                                                     trained_engine, none_engine, spec_target_dir, spec_prompts):
    # Adaptive: ragged verify lengths chosen per request (--speculative-adaptive), same guarantee.
    engine = trained_engine if not adaptive else Engine(
        **engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_dflash2_dir,
        speculative_adaptive=True)
    if adaptive == "policy":
        flat_costs(engine, monkeypatch)
    elif adaptive == "random":  # any draft block (the selector's shorter paths) and any k
        random_lengths(engine, monkeypatch, seed=2)
    prompt = spec_prompts[1]
    joint = exact_joint(load_hf_model(spec_target_dir), prompt, **config)
    sampled = {**config, "max_new_tokens": 3, "ignore_eos": True}
    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    # One greedy request rides in the same batches as the sampled ones: it stays exact.
    outs = engine.generate(input_ids=[spec_prompts[2]] + [prompt] * NUM_SAMPLES,
                           sampling_params=[greedy] + [sampled] * NUM_SAMPLES)
    assert outs[0]["output_ids"] == none_engine.generate(input_ids=spec_prompts[2], sampling_params=greedy)["output_ids"]
    samples = np.array([o["output_ids"] for o in outs[1:]])
    p_value, impossible = goodness_of_fit(samples, joint)
    assert impossible == 0
    assert p_value > 1e-3, p_value
    # The speculative path was exercised: drafts were both accepted and rejected.
    hist = np.sum([o["meta_info"]["spec_correct_drafts_histogram"] for o in outs[1:]], axis=0)
    assert hist[0] > 0 and hist[1:].sum() > NUM_SAMPLES // 20, hist
