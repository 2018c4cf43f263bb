"""TargetRunner.sample / .verify (sampling and acceptance inside the jitted step) equal the host
path (forward, logits to the host, jax_backend.sampling); unrolled / fused layer layouts equal
the default one."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_backend import SeqInput, TargetRunner, sampling
from jax_backend.batch import bucket
from tests.tiny_checkpoints import make_tiny_target

AUX = (0, 1)  # the tiny target has 2 layers: includes the last one (final-normed features)
BLOCK = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("device_steps"), "qwen3", num_hidden_layers=2)


@pytest.fixture(scope="module")
def runner(checkpoint):
    return TargetRunner(checkpoint, page_size=8, max_total_tokens=1024, max_num_seqs=8, aux_layer_ids=AUX)


@pytest.fixture(scope="module")
def prompts(runner):
    """Three sequences with cached prompts of 5, 17 and 30 tokens (page tables sized for more)."""
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    prompts = {name: rng.integers(0, vocab, n).tolist() for name, n in (("a", 5), ("b", 17), ("c", 30))}
    for name, ids in prompts.items():
        runner.allocator.allocate(name, len(ids) + 2 * BLOCK)
    runner.forward([SeqInput(ids, 0, runner.allocator.page_table(name)) for name, ids in prompts.items()])
    return prompts


def _host_sample(runner, seqs, temperature, top_p, top_k, key):
    """Today's host path (ARWorker.sample): logits to the host, padded, sampling.sample."""
    logits = np.concatenate(runner.forward(seqs).logits)
    rows = bucket(len(seqs))
    padded = np.zeros((rows, logits.shape[-1]), np.float32)
    padded[: len(seqs)] = logits
    arrays = [np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32)]
    for array, values in zip(arrays, (temperature, top_p, top_k)):
        array[: len(seqs)] = values
    return np.asarray(sampling.sample(padded, *arrays, key))[: len(seqs)]


PARAMS = {  # per sequence: temperature, top_p, top_k
    "greedy": ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0, 0, 0]),
    "plain": ([0.8, 0.0, 1.3], [1.0, 1.0, 1.0], [0, 0, 0]),
    "filtered": ([0.8, 1.0, 0.0], [0.9, 1.0, 1.0], [0, 5, 0]),
}


@pytest.mark.parametrize("kind", list(PARAMS))
def test_sample_equals_host_path(runner, prompts, kind):
    seqs = [SeqInput([7 + i], len(ids), runner.allocator.page_table(name)) for i, (name, ids) in enumerate(prompts.items())]
    temperature, top_p, top_k = PARAMS[kind]
    for seed in range(4):
        key = jax.random.PRNGKey(seed)
        expected = _host_sample(runner, seqs, temperature, top_p, top_k, key)
        got = runner.sample(seqs, temperature, top_p, top_k, key)
        np.testing.assert_array_equal(got.tokens, expected)
        assert got.tokens.dtype == np.int32
        for aux, ref in zip(got.aux_hidden, runner.forward(seqs).aux_hidden):
            np.testing.assert_allclose(np.asarray(aux), np.asarray(ref), atol=1e-5, rtol=0)


def _blocks(runner, prompts, seed):
    """A block per sequence whose first drafts are the target's own greedy tokens (so several get
    accepted) and whose later drafts are random."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i, (name, ids) in enumerate(prompts.items()):
        table = runner.allocator.page_table(name)
        block = [int(rng.integers(0, runner.config.vocab_size))]
        for _ in range(i + 1):  # i + 1 greedy drafts
            logits = runner.forward([SeqInput(block, len(ids), table, "all")]).logits[0]
            block.append(int(logits[-1].argmax()))
        block += rng.integers(0, runner.config.vocab_size, BLOCK - len(block)).tolist()
        seqs.append(SeqInput(block, len(ids), table, "all"))
    return seqs


def test_verify_greedy_equals_host_path(runner, prompts):
    seqs = _blocks(runner, prompts, seed=1)
    out = runner.forward(seqs)
    drafts = np.array([s.token_ids[1:] for s in seqs], np.int32)
    accepted, bonus = map(np.asarray, sampling.greedy_accept(drafts, np.stack(out.logits)))
    assert accepted.tolist() == [1, 2, 3]  # the greedy prefixes built above

    got = runner.verify(seqs)
    np.testing.assert_array_equal(got.accepted, accepted)
    np.testing.assert_array_equal(got.bonus, bonus)
    assert got.features.shape == (bucket(len(seqs)), BLOCK, len(AUX) * runner.config.hidden_size)
    for i, aux in enumerate(out.aux_hidden):
        expected = np.asarray(runner.hidden_state_features(aux))
        np.testing.assert_allclose(np.asarray(got.features[i]), expected, atol=1e-5, rtol=0)
    # Greedy via all-zero temperatures takes the same program.
    again = runner.verify(seqs, temperature=[0.0] * 3, top_p=[1.0] * 3, top_k=[0] * 3)
    np.testing.assert_array_equal(again.accepted, accepted)


@pytest.mark.parametrize("kind", ["plain", "filtered"])
def test_verify_rejection_sampling_equals_host_path(runner, prompts, kind):
    """Same key, same draft distribution q: the same accepted counts and bonus tokens as the
    DFLASH worker's host path (target logits to the host, sampling.probs, rejection_accept)."""
    temperature, top_p, top_k = PARAMS[kind]
    seqs = _blocks(runner, prompts, seed=2)
    rows, vocab = bucket(len(seqs)), runner.config.vocab_size

    def per_row(repeat):  # the worker's layout: each sequence's values repeated, padded neutral
        arrays = [np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32)]
        for array, values in zip(arrays, (temperature, top_p, top_k)):
            array[: len(seqs)] = values
        return [np.repeat(array, repeat) for array in arrays]

    draft_logits = np.random.default_rng(3).standard_normal((rows * (BLOCK - 1), vocab)).astype(np.float32) * 2
    q = sampling.probs(draft_logits, *per_row(BLOCK - 1)).reshape(rows, BLOCK - 1, vocab)
    drafts = np.zeros((rows, BLOCK - 1), np.int32)
    drafts[: len(seqs)] = [s.token_ids[1:] for s in seqs]
    for seed in range(4):
        key = jax.random.PRNGKey(seed)
        logits = np.zeros((rows, BLOCK, vocab), np.float32)
        logits[: len(seqs)] = np.stack(runner.forward(seqs).logits)
        target_probs = sampling.probs(logits.reshape(rows * BLOCK, vocab), *per_row(BLOCK))
        accepted, bonus = sampling.rejection_accept(drafts, q, target_probs.reshape(rows, BLOCK, vocab), key)

        got = runner.verify(seqs, temperature, top_p, top_k, draft_probs=q, key=key)
        np.testing.assert_array_equal(got.accepted, np.asarray(accepted)[: len(seqs)])
        np.testing.assert_array_equal(got.bonus, np.asarray(bonus)[: len(seqs)])


def test_ragged_verify_equals_each_block_alone(runner, prompts):
    """Blocks of different lengths (1 = a plain decode step) in one verify, padded to a fixed
    width: each sequence gets what verifying its own block alone gives, greedy and sampled."""
    full = _blocks(runner, prompts, seed=5)
    seqs = [SeqInput(seq.token_ids[: 1 + k], seq.start_pos, seq.page_table, "all") for seq, k in zip(full, (0, 4, 2))]
    got = runner.verify(seqs, block_size=BLOCK)
    assert got.features.shape[1] == BLOCK
    for i, seq in enumerate(seqs):
        alone = runner.verify([seq], block_size=BLOCK)
        assert (got.accepted[i], got.bonus[i]) == (alone.accepted[0], alone.bonus[0])
        np.testing.assert_allclose(np.asarray(got.features[i, : len(seq.token_ids)]),
                                   np.asarray(alone.features[0, : len(seq.token_ids)]), atol=1e-5, rtol=0)
    assert got.accepted[0] == 0 and got.accepted[1] <= 4 and got.accepted[2] == 2  # seq 2: 2 greedy drafts
    assert got.bonus[0] == int(runner.forward([seqs[0]]).logits[0][-1].argmax())

    # Sampling: the host path with the same key and num_drafts gives the same counts and tokens.
    temperature, top_p, top_k = PARAMS["plain"]
    rows, vocab = bucket(len(seqs)), runner.config.vocab_size
    q = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), (rows, BLOCK - 1, vocab)), axis=-1)
    key = jax.random.PRNGKey(4)
    got = runner.verify(seqs, temperature, top_p, top_k, draft_probs=q, key=key, block_size=BLOCK)
    logits = np.zeros((rows, BLOCK, vocab), np.float32)
    drafts = np.zeros((rows, BLOCK - 1), np.int32)
    for i, (seq, out) in enumerate(zip(seqs, runner.forward(seqs).logits)):
        logits[i] = out[np.minimum(np.arange(BLOCK), len(seq.token_ids) - 1)]
        drafts[i, : len(seq.token_ids) - 1] = seq.token_ids[1:]
    temps = np.repeat(np.array(temperature + [0.0] * (rows - 3), np.float32), BLOCK)
    p = sampling.probs(logits.reshape(-1, vocab), temps, np.ones_like(temps), np.zeros(len(temps), np.int32))
    accepted, bonus = sampling.rejection_accept(drafts, q, p.reshape(rows, BLOCK, vocab), key,
                                                np.array([0, 4, 2] + [0] * (rows - 3)))
    np.testing.assert_array_equal(got.accepted, np.asarray(accepted)[:3])
    np.testing.assert_array_equal(got.bonus, np.asarray(bonus)[:3])


def test_steady_state_compiles_nothing(runner, prompts):
    seqs = _blocks(runner, prompts, seed=4)
    decode = [SeqInput([3], len(ids), runner.allocator.page_table(name)) for name, ids in prompts.items()]
    runner.verify(seqs), runner.sample(decode, [0.5] * 3, [1.0] * 3, [0] * 3, jax.random.PRNGKey(0))
    compiled = runner.num_compilations()
    for seed in range(3):
        runner.verify(_blocks(runner, prompts, seed=10 + seed))
        runner.sample(decode, [0.5] * 3, [1.0] * 3, [0] * 3, jax.random.PRNGKey(seed))
    assert runner.num_compilations() == compiled


@pytest.mark.parametrize("loop, fuse", [("unrolled", False), ("scan", True), ("unrolled", True), ("switch", False),
                                        ("switch", True)])
def test_layer_layouts_equal_the_default(checkpoint, runner, loop, fuse):
    """Unrolled or switched layers and fused q/k/v, gate/up weights: the same logits and features
    up to float summation order (a mixed prefill + verify batch, prefixes past one attention chunk)."""
    other = TargetRunner(checkpoint, page_size=8, max_total_tokens=1024, max_num_seqs=8, aux_layer_ids=AUX,
                         layer_loop=loop, fuse_projections=fuse)
    prompt = np.random.default_rng(5).integers(0, runner.config.vocab_size, 300).tolist()
    results = []
    for r in (runner, other):
        table = r.allocator.allocate("layout", 400)
        r.forward([SeqInput(prompt, 0, table)])
        out = r.forward([SeqInput(list(range(8)), 300, table, "all")])
        results.append((out.logits[0], np.asarray(out.aux_hidden[0])))
        r.allocator.free("layout")
    np.testing.assert_allclose(results[1][0], results[0][0], atol=2e-5, rtol=0)
    np.testing.assert_allclose(results[1][1], results[0][1], atol=2e-5, rtol=0)
