"""Sampling correctness: with temperature > 0 (and top-p / top-k), the joint distribution of the first
3 generated tokens under DFLASH (rejection sampling over drafted blocks) equals target-only sampling.

The exact target-only distribution is computed with transformers and the z-lab reference transform
(`dflash.model._sampling_probs`); the engines' samples are checked against it with a chi-square
goodness-of-fit test (fixed seeds, so the outcome is deterministic)."""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from tests.tiny_checkpoints import load_hf_model

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

NUM_SAMPLES = 2048
VOCAB = 16
CONFIGS = [
    {"temperature": 1.0},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 0.8, "top_k": 3},
]


def exact_joint(hf, prompt, temperature, top_p=1.0, top_k=-1):
    """P(t1, t2, t3) [V, V, V] of target-only sampling, from transformers logits."""
    from dflash.model import _sampling_probs

    def probs(sequences):
        with torch.no_grad():
            logits = hf(torch.tensor(sequences)).logits[:, -1]
        return _sampling_probs(logits, temperature, top_p, max(top_k, 0)).double().numpy()

    p1 = probs([prompt])[0]
    p2 = probs([prompt + [a] for a in range(VOCAB)])
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    p3 = probs([prompt + list(pair) for pair in pairs]).reshape(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def goodness_of_fit(samples, joint):
    """Chi-square p-value of the samples [N, 3] against `joint`; cells expecting < 5 are pooled.
    Also returns how many samples fell on zero-probability cells."""
    counts = np.zeros(joint.size)
    np.add.at(counts, np.ravel_multi_index(samples.T, joint.shape), 1)
    expected = joint.ravel() * len(samples)
    impossible = int(counts[expected == 0].sum())
    big = expected >= 5
    observed, expected = counts[big], expected[big]
    rest = joint.ravel()[~big].sum() * len(samples)
    if rest > 0:  # pool the small cells into one bin
        observed = np.append(observed, counts[~big].sum())
        expected = np.append(expected, rest)
    return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue, impossible


@pytest.fixture(scope="module")
def hf_target(spec_target_dir):
    return load_hf_model(spec_target_dir)


@pytest.mark.parametrize("config", CONFIGS, ids=["t1", "top_p", "top_k"])
def test_dflash_sampling_matches_target_distribution(config, dflash_engine, none_engine, hf_target, spec_prompts):
    prompt = spec_prompts[1]
    joint = exact_joint(hf_target, prompt, **config)
    params = {**config, "max_new_tokens": 3, "ignore_eos": True}
    engine = dflash_engine(4)
    outs = engine.generate(input_ids=[prompt] * NUM_SAMPLES, sampling_params=params)
    samples = np.array([o["output_ids"] for o in outs])
    p_value, impossible = goodness_of_fit(samples, joint)
    assert impossible == 0
    assert p_value > 1e-3, p_value
    # The speculative path was really exercised: drafts were both accepted and rejected.
    hist = np.sum([o["meta_info"]["spec_correct_drafts_histogram"] for o in outs], axis=0)
    assert hist[0] > 0 and hist[1:].sum() > NUM_SAMPLES // 20, hist

    # Target-only sampling (NONE) passes the same test.
    none_samples = np.array([o["output_ids"] for o in none_engine.generate(
        input_ids=[prompt] * NUM_SAMPLES, sampling_params=params)])
    p_value, impossible = goodness_of_fit(none_samples, joint)
    assert impossible == 0 and p_value > 1e-3, p_value

    if config == CONFIGS[0]:
        # Power: at the test's own significance level (1e-3) and sample count, a nearby wrong
        # distribution is rejected.
        wrong = exact_joint(hf_target, prompt, temperature=1.25)
        assert goodness_of_fit(samples, wrong)[0] < 1e-3
