"""jax_backend.sampling vs the dflash reference transform, and the acceptance rules
(greedy exact; speculative sampling preserves the target distribution: chi-square tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import _sampling_probs
from scipy import stats

from jax_backend import sampling

P_MIN = 1e-3  # chi-square p-value floor; seeds are fixed, so these tests are deterministic


def _chi2_pvalue(counts, probs):
    probs = np.asarray(probs, np.float64)
    return stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.3, 0.8, 0), (0.9, 1.0, 5), (0.6, 0.5, 12), (1.0, 0.95, 63)],
)
def test_probs_match_dflash_reference(temperature, top_p, top_k):
    logits = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32) * 3
    ref = _sampling_probs(torch.from_numpy(logits), temperature, top_p, top_k).numpy()
    rows = logits.shape[0]
    ours = sampling.probs(
        logits, np.full(rows, temperature), np.full(rows, top_p), np.full(rows, top_k)
    )
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-6, rtol=0)


def test_probs_per_row_parameters_and_off_switches():
    logits = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
    temperature = np.array([0.0, 1.0, 1.0, 1.0, 0.5], np.float32)
    top_p = np.array([1.0, 1.0, 1.0, 0.7, 1.0], np.float32)
    top_k = np.array([0, -1, 32, 0, 4], np.int32)  # -1 and >= V mean "off"
    ours = np.asarray(sampling.probs(logits, temperature, top_p, top_k))
    np.testing.assert_array_equal(ours[0], np.eye(32)[logits[0].argmax()])  # greedy limit
    for row in range(1, 5):
        ref = _sampling_probs(
            torch.from_numpy(logits[row : row + 1]), float(temperature[row]), float(top_p[row]),
            int(max(top_k[row], 0)),
        ).numpy()[0]
        np.testing.assert_allclose(ours[row], ref, atol=1e-6, rtol=0)
    assert np.count_nonzero(ours[4]) == 4


def test_sample_greedy_rows_and_distribution():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((1, 8)).astype(np.float32) * 2
    n = 20000
    rows = np.repeat(logits, n, axis=0)
    temperature = np.where(np.arange(n) % 2 == 0, 0.8, 0.0).astype(np.float32)
    tokens = np.asarray(
        sampling.sample(rows, temperature, np.ones(n), np.full(n, 5), jax.random.key(0))
    )
    assert tokens.dtype == np.int32
    assert np.all(tokens[1::2] == logits[0].argmax())
    expected = _sampling_probs(torch.from_numpy(logits), 0.8, 1.0, 5).numpy()[0]
    counts = np.bincount(tokens[0::2], minlength=8)
    assert np.all(counts[expected == 0] == 0)  # outside top-5: never drawn
    keep = expected > 0
    assert _chi2_pvalue(counts[keep], expected[keep]) > P_MIN


def _dflash_greedy(draft, logits):
    posterior = logits.argmax(-1)
    accepted = np.cumprod(draft == posterior[:, :-1], axis=1).sum(1)
    return accepted, posterior[np.arange(len(draft)), accepted]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_is_jnp_argmax(dtype):
    """The two-reduction argmax equals jnp.argmax everywhere it could differ: ties (first
    index), a row of equal values, -inf and +inf, NaN (jnp.argmax gives the first NaN), -0.0 vs
    0.0, and rows of several vocabulary sizes and batch shapes."""
    rng = np.random.default_rng(11)
    logits = rng.integers(-3, 4, (9, 1000)).astype(np.float32)  # many ties
    logits[1] = 2.0
    logits[2] = -np.inf
    logits[3, 500] = np.inf
    logits[4, [10, 700]] = np.nan
    logits[5] = 0.0
    logits[5, 3] = -0.0
    logits[6, 999] = 100.0
    logits[7] = rng.standard_normal(1000)
    logits[8, :] = -1.0
    logits[8, 0] = np.nan
    for array in (logits, logits.reshape(3, 3, 1000), rng.standard_normal((2, 49152)).astype(np.float32)):
        array = jnp.asarray(array, dtype)
        np.testing.assert_array_equal(jax.jit(sampling.argmax)(array), jnp.argmax(array, axis=-1))
        assert jax.jit(sampling.argmax)(array).dtype == jnp.int32


def test_greedy_accept_exact():
    rng = np.random.default_rng(3)
    n, block, vocab = 6, 5, 16
    logits = rng.standard_normal((n, block, vocab)).astype(np.float32)
    target = logits.argmax(-1)
    draft = rng.integers(0, vocab, (n, block - 1))
    draft[0] = target[0, :-1]  # all accepted -> bonus from the last position
    draft[1, 0] = (target[1, 0] + 1) % vocab  # none accepted
    draft[2, :2] = target[2, :2]  # exactly 2 accepted
    draft[2, 2] = (target[2, 2] + 1) % vocab
    draft[3, :3] = target[3, :3]  # a later match after a mismatch must not count
    draft[3, 3] = target[3, 3]
    draft[3, 1] = (target[3, 1] + 1) % vocab
    accepted, bonus = map(np.asarray, sampling.greedy_accept(draft, logits))
    ref_accepted, ref_bonus = _dflash_greedy(draft, logits)
    np.testing.assert_array_equal(accepted, ref_accepted)
    np.testing.assert_array_equal(bonus, ref_bonus)
    assert list(accepted[:4]) == [4, 0, 2, 1]
    assert bonus[0] == target[0, -1] and bonus[1] == target[1, 0]


def test_rejection_accept_preserves_target_distribution():
    """Toy 2-draft block (B = 3) over 6 tokens with position-dependent p and q. The emitted
    token at each position (draft if accepted, else the bonus) must follow p at that
    position, the first draft's acceptance rate must be sum(min(p, q)), and when both drafts
    pass the bonus must follow p at the last position."""
    vocab, n = 6, 60000
    p = np.array(
        [[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
         [0.05, 0.50, 0.05, 0.20, 0.10, 0.10],
         [0.10, 0.10, 0.40, 0.05, 0.05, 0.30]], np.float32)
    q = np.array(
        [[0.10, 0.30, 0.20, 0.10, 0.00, 0.30],
         [0.20, 0.30, 0.20, 0.10, 0.10, 0.10]], np.float32)
    rng = np.random.default_rng(4)
    draft = np.stack([rng.choice(vocab, n, p=q[j]) for j in range(2)], axis=1)
    accepted, bonus = map(
        np.asarray,
        sampling.rejection_accept(
            draft, np.broadcast_to(q, (n, 2, vocab)), np.broadcast_to(p, (n, 3, vocab)),
            jax.random.key(5),
        ),
    )
    assert accepted.min() >= 0 and accepted.max() <= 2

    first = np.where(accepted >= 1, draft[:, 0], bonus)
    counts = np.bincount(first, minlength=vocab)
    assert _chi2_pvalue(counts, p[0]) > P_MIN

    accept_rate = np.minimum(p[0], q[0]).sum()
    assert abs(np.mean(accepted >= 1) - accept_rate) < 4 * np.sqrt(accept_rate * (1 - accept_rate) / n)

    # Second position, among rows that accepted the first draft (p does not depend on the prefix).
    rows = accepted >= 1
    second = np.where(accepted[rows] >= 2, draft[rows, 1], bonus[rows])
    counts = np.bincount(second, minlength=vocab)
    assert _chi2_pvalue(counts, p[1]) > P_MIN

    all_in = accepted == 2
    counts = np.bincount(bonus[all_in], minlength=vocab)
    assert _chi2_pvalue(counts, p[2]) > P_MIN


def test_ragged_acceptance_verifies_only_each_rows_drafts():
    """num_drafts per row (ragged blocks padded to one width): greedy never accepts past a row's
    own drafts and takes the bonus right after them; rejection sampling with num_drafts = k emits
    tokens distributed as p at every position, the bonus after k passes from p at position k."""
    rng = np.random.default_rng(8)
    n, block, vocab = 5, 6, 16
    logits = rng.standard_normal((n, block, vocab)).astype(np.float32)
    target = logits.argmax(-1)
    draft = target[:, :-1].copy()  # every draft matches
    accepted, bonus = map(np.asarray, sampling.greedy_accept(draft, logits, np.array([0, 1, 3, 5, 2])))
    assert accepted.tolist() == [0, 1, 3, 5, 2]
    np.testing.assert_array_equal(bonus, target[np.arange(n), accepted])

    p = np.array([[0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
                  [0.05, 0.50, 0.05, 0.20, 0.10, 0.10],
                  [0.10, 0.10, 0.40, 0.05, 0.05, 0.30]], np.float32)
    q = np.array([[0.10, 0.30, 0.20, 0.10, 0.00, 0.30],
                  [0.20, 0.30, 0.20, 0.10, 0.10, 0.10]], np.float32)
    rows, vocab = 60000, 6
    k = rng.integers(0, 3, rows)  # 0, 1 or 2 drafts verified
    draft = np.stack([rng.choice(vocab, rows, p=q[j]) for j in range(2)], axis=1)
    accepted, bonus = map(np.asarray, sampling.rejection_accept(
        draft, np.broadcast_to(q, (rows, 2, vocab)), np.broadcast_to(p, (rows, 3, vocab)), jax.random.key(9), k))
    assert np.all(accepted <= k)
    first = np.where(accepted >= 1, draft[:, 0], bonus)
    assert _chi2_pvalue(np.bincount(first, minlength=vocab), p[0]) > P_MIN
    for verified in (0, 1):  # all verified drafts passed: the bonus follows p right after them
        done = (k == verified) & (accepted == verified)
        assert _chi2_pvalue(np.bincount(bonus[done], minlength=vocab), p[verified]) > P_MIN
    second = (k == 2) & (accepted >= 1)
    emitted = np.where(accepted[second] >= 2, draft[second, 1], bonus[second])
    assert _chi2_pvalue(np.bincount(emitted, minlength=vocab), p[1]) > P_MIN


def test_rejection_accept_identical_distributions_accept_everything():
    p = jax.nn.softmax(jax.random.normal(jax.random.key(6), (4, 3, 10)), axis=-1)
    draft = jnp.argmax(p[:, :2], axis=-1)
    accepted, _ = sampling.rejection_accept(draft, p[:, :2], p, jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(accepted), [2, 2, 2, 2])


def test_fast_paths_equal_the_sorted_transform():
    """No top-k/top-p: `probs` skips the vocabulary sort; an all-greedy batch `sample`s by argmax.
    Both must give exactly what the general (sorted) transform gives, ties included."""
    logits = np.random.default_rng(5).standard_normal((6, 40)).astype(np.float32)
    logits[0, [3, 17]] = logits[0].max() + 1.0  # a tie: the lower id wins everywhere
    temperature = np.array([0.0, 1.0, 0.5, 0.0, 1.7, 1.0], np.float32)
    off_p, off_k = np.ones(6, np.float32), np.zeros(6, np.int32)
    fast = np.asarray(sampling.probs(logits, temperature, off_p, off_k))
    general = np.asarray(sampling._filtered_probs(logits, temperature, off_p, off_k))
    np.testing.assert_allclose(fast, general, atol=1e-7, rtol=0)
    assert fast[0].argmax() == 3 and fast[0, 3] == 1.0
    greedy = np.asarray(sampling.sample(logits, np.zeros(6, np.float32), off_p, off_k, jax.random.key(0)))
    general_greedy = np.asarray(sampling._draw(logits, general, np.zeros(6, np.float32), jax.random.key(0)))
    np.testing.assert_array_equal(greedy, general_greedy)
    assert greedy[0] == 3


def test_top_p_and_top_k_past_the_candidates_match_the_reference():
    """A vocabulary larger than `NUM_CANDIDATES`: rows whose kept tokens lie within the candidates
    (peaked, a small top-k) and, in another batch, rows that need the whole sorted vocabulary (a
    flat nucleus, a top-k past the candidates) beside them: both equal the dflash reference."""
    vocab = sampling.NUM_CANDIDATES * 3
    rng = np.random.default_rng(6)
    peaked = rng.standard_normal((4, vocab)).astype(np.float32) * 6
    peaked[0, [7, 900]] = peaked[0].max() + 0.5  # a tie among the best: the lower id first
    flat = rng.standard_normal((2, vocab)).astype(np.float32) * 0.1  # a nucleus of most of V
    cases = [(peaked, [0.8, 1.0, 0.7, 0.0], [0.95, 0.9, 1.0, 0.9], [0, 50, 0, 0]),
             (np.concatenate([peaked[:2], flat]), [0.8, 1.0, 1.0, 1.2], [0.95, 1.0, 0.9, 1.0], [0, 0, 0, 2000])]
    for logits, temperature, top_p, top_k in cases:
        ours = np.asarray(sampling.probs(logits, np.array(temperature, np.float32), np.array(top_p, np.float32),
                                         np.array(top_k, np.int32)))
        for row in range(len(logits)):
            if temperature[row] == 0:
                np.testing.assert_array_equal(ours[row], np.eye(vocab)[logits[row].argmax()])
                continue
            ref = _sampling_probs(torch.from_numpy(logits[row : row + 1]), temperature[row], top_p[row],
                                  top_k[row]).numpy()[0]
            np.testing.assert_allclose(ours[row], ref, atol=1e-6, rtol=0)
    kept = np.count_nonzero(ours, axis=-1)
    assert kept[2] > sampling.NUM_CANDIDATES and kept[3] == 2000  # these needed the whole sort
