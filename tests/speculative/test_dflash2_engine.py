"""A DFlash 2 drafter served through `Engine` (DFLASH, greedy): the same tokens and accepted-draft
histograms as the z-lab reference's `dflash_generate`, and the same tokens as NONE.

Only greedy decoding: today's DFLASH worker samples drafts from per-position logits, which a
DFlash 2 drafter does not offer (`DFlashProposer.propose_path` is the sampling entry point)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sgl_dflash.entrypoints.engine import Engine
from tests.conftest import DRAFT_LAYER_IDS
from tests.tiny_checkpoints import load_hf_model
from tests.tiny_draft import DFLASH2_TINY, make_tiny_draft

pytestmark = pytest.mark.slow  # engines end to end: not in the fast lane


@pytest.fixture(scope="module")
def dflash2_draft_dir(tmp_path_factory, spec_target_dir):
    return str(make_tiny_draft(tmp_path_factory.mktemp("dflash2_draft"), spec_target_dir, num_layers=2, block_size=8,
                               target_layer_ids=DRAFT_LAYER_IDS, dflash2=DFLASH2_TINY, seed=4))


def test_engine_greedy_matches_dflash_generate(monkeypatch, engine_kwargs, spec_target_dir, dflash2_draft_dir,
                                               spec_prompts, none_engine):
    import dflash.model
    from dflash.model import DFlash2DraftModel, dflash_generate

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)  # its stats timer needs CUDA
    block, new_tokens = 8, 40
    engine = Engine(**engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=dflash2_draft_dir)
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
