"""DFlash 2 pieces on their own: the convolution's block edges, torchax lowering, a fresh drafter's
identity, the sampler's distribution, and rejection sampling with q over the candidates."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats

from jax_backend import sampling
from tests.tiny_draft import DFLASH2_TINY, make_tiny_draft, single_torch_thread  # noqa: F401
from torchax_proposer import DFlash2DraftModel, DFlashConfig, DFlashDraftModel, DFlashProposer, load_draft_model
from torchax_proposer.dflash2_jax import dense_draft_probs, select_path
from torchax_proposer.jax_drafter import call_model, model_params

TARGET_MODEL = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    vocab_size=256, num_hidden_layers=4,
)
TARGET = dict(hidden_size=64, vocab_size=256, num_hidden_layers=4)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_draft(tmp_path_factory.mktemp("draft"), TARGET_MODEL, num_layers=2, block_size=8,
                           target_layer_ids=[1, 2], dflash2=dict(DFLASH2_TINY, conv_kernel_size=3))


@pytest.fixture(scope="module")
def drafter(draft_dir):
    return load_draft_model(draft_dir, TARGET)


def test_convolution_stops_at_block_edges(drafter):
    """Blocks packed in one row (training) convolve exactly as each block alone (serving)."""
    conv = drafter.layers[0].attention_conv
    x = torch.randn(2, 3 * 8, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed, packed_kernel = conv.prepare(x, block_len=8)
        packed = conv.finish(packed, packed_kernel, block_len=8)
        for b in range(3):
            alone, kernel = conv.prepare(x[:, 8 * b : 8 * b + 8])
            torch.testing.assert_close(packed[:, 8 * b : 8 * b + 8], conv.finish(alone, kernel), atol=1e-6, rtol=0)
        # Across a block edge the taps do reach back: one long block differs from three.
        whole, kernel = conv.prepare(x)
        assert not torch.allclose(conv.finish(whole, kernel)[:, 8:], packed[:, 8:], atol=1e-3)


def test_eager_equals_torchax_jit(drafter):
    gen = torch.Generator().manual_seed(1)
    config = drafter.config
    inputs = dict(
        context_features=torch.randn(2, 6, config.num_context_features, generator=gen),
        context_positions=torch.arange(6)[None].repeat(2, 1),
        noise_embedding=torch.randn(2, 8, 64, generator=gen),
        block_positions=torch.arange(6, 14)[None].repeat(2, 1),
    )
    lm_head = torch.randn(256, 64, generator=gen) / 8
    anchors = torch.tensor([5, 77])
    params = model_params(drafter)
    as_jax = lambda tree: jax.tree_util.tree_map(lambda t: jnp.asarray(t.numpy()), tree)  # noqa: E731

    hidden_jax, _ = jax.jit(lambda p, kw: call_model(drafter, p, **kw))(params, as_jax(inputs))
    hidden_jax = hidden_jax[:, 1:]
    # Row 0 samples at T = 0.8, row 1 is greedy (T = 0); the greedy-only program (temperatures
    # None) is checked against the reference in test_dflash2_reference.py.
    temperatures, key = jnp.array([0.8, 0.0]), jax.random.key(4)
    sampled = jax.jit(functools.partial(select_path, drafter))(
        params, hidden_jax, jnp.asarray(lm_head.numpy()), jnp.asarray(anchors.numpy()), temperatures=temperatures, key=key
    )
    with torch.no_grad():
        hidden, _ = drafter(**inputs)
        hidden = hidden[:, 1:]
        np.testing.assert_allclose(np.asarray(hidden_jax), hidden.numpy(), atol=1e-5, rtol=0)
        greedy = drafter.propose(hidden, anchors, lm_head)
        # The same Gumbel noise the jitted step draws from its key.
        gumbel = torch.from_numpy(np.array(jax.random.gumbel(key, (2, 7, drafter.top_k), jnp.float32)))
        path, candidates, probs = drafter.propose(
            hidden, anchors, lm_head, temperature=torch.tensor([0.8, 0.0]), gumbel=gumbel
        )
    assert greedy[2] is None and torch.equal(greedy[1], candidates)
    assert np.array_equal(sampled[0], path.numpy()) and np.array_equal(sampled[1], candidates.numpy())
    # q is a softmax of scores that agree to ~1e-5 (the hidden states above): fp32 reduction
    # order (XLA's threads vs torch's) moved a probability by 1.3e-6 in one CI run.
    np.testing.assert_allclose(np.asarray(sampled[2]), probs.numpy(), atol=1e-5, rtol=0)
    assert not torch.equal(path[0], greedy[0][0])  # row 0 sampled another path than the greedy one
    assert torch.equal(path[1], greedy[0][1])  # row 1 (T = 0) is greedy


def test_fresh_dflash2_drafter_is_the_dflash1_drafter(draft_dir):
    """New convolutions are the identity and a new selector adds nothing: a DFlash 2 drafter
    initialised from a DFlash 1 one drafts the same tokens (training starts from there)."""
    config2 = DFlashConfig.from_pretrained(draft_dir)
    raw = {**config2.raw, "architectures": ["DFlashDraftModel"]}
    dflash1 = DFlashDraftModel(DFlashConfig.from_dict(raw))
    dflash2 = DFlash2DraftModel(config2)
    missing, unexpected = dflash2.load_state_dict(dflash1.state_dict(), strict=False)
    assert not unexpected and all("_conv." in name or "candidate_selector." in name for name in missing)
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 5, config2.num_context_features, generator=gen)
    noise = torch.randn(1, 8, 64, generator=gen)
    lm_head = torch.randn(256, 64, generator=gen)
    with torch.no_grad():
        h1, _ = dflash1(features, torch.arange(5)[None], noise, torch.arange(5, 13)[None])
        h2, _ = dflash2(features, torch.arange(5)[None], noise, torch.arange(5, 13)[None])
        torch.testing.assert_close(h2, h1, atol=1e-6, rtol=0)
        path = dflash2.propose(h2[:, 1:], torch.tensor([3]), lm_head)[0]
    assert torch.equal(path, dflash1.compute_logits(h1[:, 1:], lm_head).argmax(-1))


@pytest.fixture(scope="module")
def many_paths(drafter):
    """4000 independent paths of one block at T = 1 (one row each), with their q."""
    gen = torch.Generator().manual_seed(3)
    rows = 4000
    hidden = jnp.asarray(np.repeat(torch.randn(1, 7, 64, generator=gen).numpy(), rows, 0))
    lm_head = jnp.asarray((torch.randn(256, 64, generator=gen) / 4).numpy())
    select = jax.jit(functools.partial(select_path, drafter))
    path, candidates, probs = select(model_params(drafter), hidden, lm_head, jnp.full((rows,), 9),
                                     temperatures=jnp.ones(rows), key=jax.random.key(5))
    return np.asarray(path), np.asarray(candidates), np.asarray(probs)


def chisquare_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square over the cells with an expected count >= 5 (the rest lumped into one cell)."""
    big = expected >= 5
    observed = np.append(observed[big], observed[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    return stats.chisquare(observed[keep], expected[keep] * observed[keep].sum() / expected[keep].sum()).pvalue


def test_sampled_paths_follow_q(many_paths):
    """Each draft is drawn from the q returned for its position given the draft before it: the
    first two drafts' joint frequencies match q_1(a) * q_2(b | a)."""
    path, candidates, probs = many_paths
    rows, top_k = len(path), probs.shape[-1]
    assert np.all(candidates == candidates[0]) and np.allclose(probs[:, 0], probs[0, 0])
    first = (candidates[:, 0] == path[:, :1]).argmax(-1)
    second = (candidates[:, 1] == path[:, 1:2]).argmax(-1)
    observed = np.zeros((top_k, top_k))
    np.add.at(observed, (first, second), 1)
    expected = np.zeros((top_k, top_k))
    for a in range(top_k):
        given_a = np.nonzero(first == a)[0]
        if len(given_a):  # q_2 depends on the sampled predecessor only
            assert np.allclose(probs[given_a, 1], probs[given_a[0], 1], atol=1e-6)
            expected[a] = probs[0, 0, a] * probs[given_a[0], 1] * rows
    assert len(np.unique(path[:, 0])) > 1 and len(np.unique(path[:, 1])) > 2  # really random
    assert chisquare_pvalue(observed.ravel(), expected.ravel()) > 1e-3


def test_rejection_with_candidate_q_is_lossless(many_paths):
    """`dense_draft_probs` + `rejection_accept`: the first emitted token is distributed as the
    target's p whatever the selector's q (here half of p's mass lies off the candidates)."""
    path, candidates, probs = many_paths
    rows, gamma, vocab = len(path), path.shape[1], 256
    gen = np.random.default_rng(6)
    p = np.zeros(vocab)
    p[candidates[0, 0]] = gen.dirichlet(np.ones(len(candidates[0, 0]))) * 0.5
    others = np.setdiff1d(np.arange(vocab), candidates[0, 0])[:12]
    p[others] = gen.dirichlet(np.ones(len(others))) * 0.5
    target_probs = jnp.asarray(np.broadcast_to(p, (rows, gamma + 1, vocab)).astype(np.float32))
    draft_probs = dense_draft_probs(candidates, probs, vocab)
    assert draft_probs.shape == (rows, gamma, vocab)
    np.testing.assert_allclose(np.asarray(draft_probs[0, 0, candidates[0, 0]]), probs[0, 0], atol=0)
    accepted, bonus = sampling.rejection_accept(jnp.asarray(path), draft_probs, target_probs, jax.random.key(7))
    accepted, bonus = np.asarray(accepted), np.asarray(bonus)
    first = np.where(accepted > 0, path[:, 0], bonus)
    assert 0 < np.mean(accepted > 0) < 1  # both the accepted and the residual branch ran
    assert chisquare_pvalue(np.bincount(first, minlength=vocab).astype(float), p * rows) > 1e-3


def test_token_map_needs_top_k_ids(draft_dir):
    arrays = dict(target_embed=np.zeros((256, 64), np.float32), target_lm_head=np.zeros((256, 64), np.float32))
    with pytest.raises(ValueError, match=r"token_map has 3 ids, fewer than the DFlash 2 selector's selector_top_k=4"):
        DFlashProposer(draft_dir, **arrays, target_config=TARGET, max_num_seqs=1, max_context_len=16,
                       token_map=[4, 5, 6])
