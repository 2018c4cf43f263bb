"""DFlashProposer as a state machine: no drift, no length inflation, no steady-state recompiles."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch

from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft, single_torch_thread  # noqa: F401
from torchax_proposer import DFlashProposer, DrafterStateError, TorchDrafter, load_draft_model

TARGET = dict(hidden_size=64, vocab_size=256, num_hidden_layers=4)
BLOCK = 8
FEATURES = 2 * 64  # two target layers x hidden


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target_dir = make_tiny_target(tmp_path_factory.mktemp("target"), "qwen3", num_hidden_layers=4)
    draft_dir = make_tiny_draft(
        tmp_path_factory.mktemp("draft"), target_dir, num_layers=2, block_size=BLOCK, target_layer_ids=[1, 2]
    )
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def target_head():
    # Scaled like a real (tiny) target's weights, so logits are O(1) and fp32 error ~1e-6.
    rng = np.random.default_rng(0)
    embed, lm_head = (0.1 * rng.standard_normal((2, 256, 64))).astype(np.float32)
    return embed, lm_head


def make_proposer(dirs, target_head, **kwargs) -> DFlashProposer:
    embed, lm_head = target_head
    options = dict(max_num_seqs=4, max_context_len=384)
    options.update(kwargs)
    return DFlashProposer(dirs[1], target_embed=embed, target_lm_head=lm_head, target_config=TARGET, **options)


def rows(rng, n: int) -> jax.Array:
    # Device arrays, as the runtime passes the target's aux hidden states. (device_put, not
    # jnp.asarray: the latter compiles a tiny program per shape, which would blur the count below.)
    return jax.device_put(rng.standard_normal((n, FEATURES), dtype=np.float32))


def assert_same_state(a: DFlashProposer, seq_a, b: DFlashProposer, seq_b) -> None:
    assert a.committed_len(seq_a) == b.committed_len(seq_b)
    for (ka, va), (kb, vb) in zip(a.context_kv(seq_a), b.context_kv(seq_b)):
        assert ka.shape == kb.shape
        np.testing.assert_allclose(ka, kb, atol=1e-5, rtol=0)
        np.testing.assert_allclose(va, vb, atol=1e-5, rtol=0)


def test_long_run_equals_fresh_drafter(dirs, target_head):
    """Many propose/commit steps with every accepted count 0 .. B-1, two sequences of different
    lengths in one batch, one of them in a reused slot: the state equals that of a fresh proposer
    given the whole committed context at once, and so do the next drafts."""
    rng = np.random.default_rng(1)
    proposer = make_proposer(dirs, target_head)
    proposer.add("old", rows(rng, 30))
    proposer.propose(["old"], [5])
    proposer.commit(["old"], [BLOCK - 1], [rows(rng, BLOCK)])
    proposer.propose(["old"], [6])  # "old" now has 38 cached rows that "b" must never see
    old_slot = proposer._seqs["old"].slot
    proposer.release("old")

    history = {"a": [rows(rng, 3)], "b": [rows(rng, 11)]}
    for seq, prompt in history.items():
        proposer.add(seq, prompt[0])
    assert proposer._seqs["a"].slot == old_slot  # the stale slot is really reused
    counts = [0, 1, 2, 3, 4, 5, 6, 7]
    for step in range(24):
        proposer.propose(["a", "b"], rng.integers(0, 256, 2))
        accepted = [counts[step % BLOCK], counts[(3 * step + 1) % BLOCK]]
        new_rows = [rows(rng, a + 1) for a in accepted]
        proposer.commit(["a", "b"], accepted, new_rows)
        for seq, r in zip(("a", "b"), new_rows):
            history[seq].append(r)
    expected_len = {seq: sum(len(r) for r in parts) for seq, parts in history.items()}
    assert {seq: proposer.committed_len(seq) for seq in history} == expected_len

    fresh = make_proposer(dirs, target_head)
    fresh.prefill_chunk = 32  # the whole context goes in through several prefill chunks
    for seq, parts in history.items():
        fresh.add(seq, np.concatenate([np.asarray(r) for r in parts]))
    bonus = [17, 201]
    tokens, logits = proposer.propose(["a", "b"], bonus, return_logits=True)
    fresh_tokens, fresh_logits = fresh.propose(["a", "b"], bonus, return_logits=True)
    np.testing.assert_array_equal(tokens, fresh_tokens)
    np.testing.assert_allclose(logits, fresh_logits, atol=1e-5, rtol=0)
    for seq in history:
        assert proposer.committed_len(seq) == expected_len[seq]  # propose never inflates the length
        assert_same_state(proposer, seq, fresh, seq)


def test_matches_eager_torch_drafter(dirs, target_head):
    """Batched JAX proposer == one-sequence-at-a-time eager TorchDrafter, step after step."""
    rng = np.random.default_rng(2)
    embed, lm_head = target_head
    proposer = make_proposer(dirs, target_head)
    eager = TorchDrafter(load_draft_model(dirs[1], TARGET), torch.from_numpy(embed), torch.from_numpy(lm_head))
    seqs = [0, 1, 2]
    for seq, n in zip(seqs, (4, 9, 25)):
        prompt = rows(rng, n)
        proposer.add(seq, prompt)
        eager.add(seq, torch.tensor(np.asarray(prompt)))
    for step in range(5):
        bonus = rng.integers(0, 256, len(seqs))
        tokens, logits = proposer.propose(seqs, bonus, return_logits=True)
        eager_tokens, eager_logits = eager.propose(seqs, bonus.tolist(), return_logits=True)
        np.testing.assert_allclose(logits, eager_logits.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(tokens, eager_tokens.numpy())
        accepted = rng.integers(0, BLOCK, len(seqs))
        new_rows = [rows(rng, a + 1) for a in accepted]
        proposer.commit(seqs, accepted, new_rows)
        eager.commit(seqs, accepted.tolist(), [torch.tensor(np.asarray(r)) for r in new_rows])
    for seq in seqs:
        assert proposer.committed_len(seq) == eager.committed_len(seq)


def test_token_map_drafts_are_the_argmax_over_the_map(dirs, target_head):
    """--speculative-token-map (FR-Spec): the lm_head shrinks to the mapped ids; drafts are the
    full drafter's argmax restricted to them, and the returned logits are the full ones there and
    -inf elsewhere (a valid proposal distribution for rejection sampling)."""
    rng = np.random.default_rng(7)
    vocab = target_head[1].shape[0]
    token_map = np.sort(rng.choice(vocab, size=vocab // 3, replace=False))
    full, mapped = make_proposer(dirs, target_head), make_proposer(dirs, target_head, token_map=token_map.tolist())
    for seq, n in zip((0, 1), (6, 17)):
        prompt = rows(rng, n)
        full.add(seq, prompt)
        mapped.add(seq, prompt)
    for step in range(3):
        bonus = rng.integers(0, vocab, 2)
        _, full_logits = full.propose([0, 1], bonus, return_logits=True)
        tokens, logits = mapped.propose([0, 1], bonus, return_logits=True)
        np.testing.assert_array_equal(tokens, token_map[full_logits[..., token_map].argmax(-1)])
        np.testing.assert_allclose(logits[..., token_map], full_logits[..., token_map], atol=1e-5, rtol=0)
        outside = np.setdiff1d(np.arange(vocab), token_map)
        assert np.all(np.isneginf(logits[..., outside]))
        accepted = rng.integers(0, BLOCK, 2)
        new_rows = [rows(rng, a + 1) for a in accepted]
        full.commit([0, 1], accepted, new_rows)
        mapped.commit([0, 1], accepted, new_rows)
    with pytest.raises(ValueError, match="token_map"):
        make_proposer(dirs, target_head, token_map=[0, 0, 1])


def test_no_recompilation_in_steady_state(dirs, target_head):
    """After one warm-up generation, a second one with other prompt lengths, batch sizes and
    accepted counts inside the same buckets compiles nothing: neither our jitted functions nor
    anything else in JAX."""
    compiles = []
    listening = [True]

    def on_event(name, duration, **kwargs):
        if listening[0] and name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        proposer = make_proposer(dirs, target_head, max_context_len=256)

        def generation(seed: int, prompt_lens: list[int], steps: int) -> list[int]:
            rng = np.random.default_rng(seed)
            seqs = [f"{seed}-{i}" for i in range(len(prompt_lens))]
            for seq, n in zip(seqs, prompt_lens):
                proposer.add(seq, rows(rng, n))
            for step in range(steps):
                active = seqs if step % 3 else seqs[:2]  # batch buckets 4 and 2
                proposer.propose(active, rng.integers(0, 256, len(active)), return_logits=step % 2 == 0)
                accepted = rng.integers(0, BLOCK, len(active))
                proposer.commit(active, accepted, [rows(rng, a + 1) for a in accepted])
            lengths = [proposer.committed_len(s) for s in seqs]
            for seq in seqs:
                proposer.release(seq)
            return lengths

        # Warm-up: contexts grow through the 128 and 256 cache windows, every accepted count.
        assert 128 < max(generation(0, [20, 7, 31], steps=40)) <= 256
        compiled = proposer.num_compilations()
        assert compiled > 0
        compiles.clear()
        assert 128 < max(generation(1, [12, 29, 3], steps=35)) <= 256
        assert proposer.num_compilations() == compiled
        assert compiles == []
    finally:
        listening[0] = False


def test_double_commit(dirs, target_head):
    """Two commits in a row (no propose between) lose nothing."""
    rng = np.random.default_rng(3)
    proposer = make_proposer(dirs, target_head)
    parts = [rows(rng, 10), rows(rng, 2), rows(rng, 4)]
    proposer.add(0, parts[0])
    proposer.commit([0], [1], [parts[1]])
    proposer.commit([0], [3], [torch.tensor(np.asarray(parts[2]))])  # torch input works too
    assert proposer.committed_len(0) == 16
    fresh = make_proposer(dirs, target_head)
    fresh.add(0, np.concatenate([np.asarray(p) for p in parts]))
    np.testing.assert_array_equal(proposer.propose([0], [9]), fresh.propose([0], [9]))
    assert_same_state(proposer, 0, fresh, 0)


@pytest.mark.parametrize("draft_pending_rows", [BLOCK, 2])
def test_commit_block_without_propose_keeps_rows_pending(dirs, target_head, draft_pending_rows):
    """The adaptive worker's plain steps: commit_block without a propose between appends to the
    pending rows (flushed to the cache when the bucket is full); the state equals a fresh
    proposer's, and the confidences are the drafts' softmax probabilities. The verify batch is
    padded (4 rows for 2 sequences, as the runner pads it) and the two sequences hold every slot:
    a padding row written anywhere would show. With draft_pending_rows 2 (the adaptive worker's),
    drafts read 2 pending rows and flush the sequences with more first."""
    rng = np.random.default_rng(6)
    proposer = make_proposer(dirs, target_head, max_num_seqs=2)
    proposer.draft_pending_rows = draft_pending_rows
    flushed, flush = [], proposer._flush
    proposer._flush = lambda states: (flushed.append(len(states)) if states else None, flush(states))
    history = {"a": [rows(rng, 5)], "b": [rows(rng, 9)]}
    for seq, prompt in history.items():
        proposer.add(seq, prompt[0])
    # Per step: which sequences were drafted, and the accepted counts (0 for undrafted ones).
    steps = [({"a", "b"}, [1, 0]), ({"a", "b"}, [2, 0]), (set(), [0, 0]), ({"a"}, [3, 0]), (set(), [0, 0])] + [(set(), [0, 0])] * 9
    steps += [({"b"}, [0, 5]), ({"a", "b"}, [1, 7])]
    for drafted, accepted in steps:
        if drafted:
            proposer.propose(sorted(drafted), [3] * len(drafted))
        block = jax.device_put(rng.standard_normal((4, BLOCK, FEATURES), dtype=np.float32))
        proposer.commit_block(["a", "b"], accepted, block)
        for i, seq in enumerate(("a", "b")):
            history[seq].append(block[i, : accepted[i] + 1])
    fresh = make_proposer(dirs, target_head)
    for seq, parts in history.items():
        fresh.add(seq, np.concatenate([np.asarray(r) for r in parts]))
        assert proposer.committed_len(seq) == fresh.committed_len(seq)
    tokens, confidence = proposer.propose(["a", "b"], [7, 8], return_confidence=True)
    fresh_tokens, logits = fresh.propose(["a", "b"], [7, 8], return_logits=True)
    np.testing.assert_array_equal(tokens, fresh_tokens)
    expected = np.exp(logits.max(-1)) / np.exp(logits).sum(-1)
    np.testing.assert_allclose(confidence, expected, atol=1e-5, rtol=0)
    for seq in history:
        assert_same_state(proposer, seq, fresh, seq)
    # Rows pending before each draft (a / b): 0 / 0, 2 / 1, 4 / -, - / 5, 7 / 6 and the last 2 / 8,
    # so with 2 rows read, a, b, both and b are flushed first; and in the run of plain steps a full
    # pool flushes a, then b (both settings).
    assert flushed == ([1, 1, 1, 1, 2, 1] if draft_pending_rows == 2 else [1, 1])


def test_shorter_draft_block_equals_a_proposer_of_that_block(dirs, target_head):
    """propose(block_size=b) (the adaptive worker's cheaper draft step) drafts what a proposer
    built for block b drafts from the same state, and leaves a state the full block continues
    from; its programs are counted; a block outside [2, B] is refused."""
    rng = np.random.default_rng(8)
    prompt, block_rows = rows(rng, 11), rng.standard_normal((1, BLOCK, FEATURES), dtype=np.float32)
    full, small = make_proposer(dirs, target_head), make_proposer(dirs, target_head, block_size=4)
    compiled = full.num_compilations()
    for proposer in (full, small):
        proposer.add(0, prompt)
    tokens, confidence = full.propose([0], [5], return_confidence=True, block_size=4)
    small_tokens, small_logits = small.propose([0], [5], return_logits=True)
    assert tokens.shape == confidence.shape == (1, 3)
    np.testing.assert_array_equal(tokens, small_tokens)
    np.testing.assert_allclose(confidence, np.exp(small_logits.max(-1)) / np.exp(small_logits).sum(-1), atol=1e-5)
    assert full.num_compilations() > compiled
    for proposer in (full, small):
        proposer.commit_block([0], [2], jax.device_put(block_rows[:, : proposer.block_size]))
    assert_same_state(full, 0, small, 0)
    assert full.propose([0], [6]).shape == (1, BLOCK - 1)
    with pytest.raises(ValueError, match=r"\[2, 8\]"):
        full.propose([0], [6], block_size=16)
    with pytest.raises(ValueError, match=r"\[2, 4\]"):
        small.propose([0], [6], block_size=8)


@pytest.mark.slow
def test_bfloat16_close_to_float32(dirs, target_head):
    rng = np.random.default_rng(4)
    prompt = rows(rng, 12)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        proposer = make_proposer(dirs, target_head, dtype=dtype)
        proposer.add(0, prompt)
        _, logits[dtype] = proposer.propose([0], [3], return_logits=True)
    scale = np.abs(logits["float32"]).max()
    assert np.abs(logits["bfloat16"] - logits["float32"]).max() < 0.05 * scale


def test_empty_batch(dirs, target_head):
    proposer = make_proposer(dirs, target_head)
    assert proposer.propose([], []).shape == (0, BLOCK - 1)


@pytest.mark.parametrize(
    "action, message",
    [
        (lambda p, r: p.add("s", r(3)), "already added"),
        (lambda p, r: p.propose(["nope"], [1]), "unknown sequence 'nope'"),
        (lambda p, r: p.propose(["s", "s"], [1, 2]), "duplicate"),
        (lambda p, r: p.propose(["s"], [1, 2]), "2 bonus tokens for 1 sequences"),
        (lambda p, r: p.propose(["s"], [256]), "bonus tokens must be token ids"),
        (lambda p, r: p.commit(["s"], [BLOCK], [r(BLOCK + 1)]), "accepted count 8 outside"),
        (lambda p, r: p.commit(["s"], [2], [r(2)]), "got 2 feature rows, expected 3"),
        (lambda p, r: p.commit(["s"], [0], [np.zeros((1, 5), np.float32)]), r"shape \(1, 5\), expected \[rows, 128\]"),
        (lambda p, r: p.commit(["s"], [0, 1], [r(1)]), "1 ids, 2 accepted counts"),
        (lambda p, r: p.add("t", r(0)), "got 0 feature rows"),
        (lambda p, r: p.add("t", r(65)), "exceeds max_context_len=64"),
        (lambda p, r: [p.commit(["s"], [BLOCK - 1], [r(BLOCK)]) for _ in range(8)], "exceeds max_context_len"),
        (lambda p, r: [p.add(i, r(1)) for i in range(4)], "all 4 drafter slots are in use"),
        (lambda p, r: p.release("nope"), "unknown sequence"),
    ],
)
def test_state_errors(dirs, target_head, action, message):
    rng = np.random.default_rng(5)
    proposer = make_proposer(dirs, target_head, max_context_len=64)
    proposer.add("s", rows(rng, 3))
    with pytest.raises(DrafterStateError, match=message):
        action(proposer, lambda n: rows(rng, n))


def test_bad_construction(dirs, target_head):
    embed, lm_head = target_head
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        make_proposer(dirs, target_head, block_size=1)
    with pytest.raises(ValueError, match=r"target_lm_head has shape \(256, 32\)"):
        DFlashProposer(dirs[1], target_embed=embed, target_lm_head=lm_head[:, :32], target_config=TARGET,
                       max_num_seqs=1, max_context_len=8)
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_proposer(dirs, target_head, dtype="int8")


def test_torch_drafter_state_errors(dirs, target_head):
    embed, lm_head = (torch.tensor(a) for a in target_head)
    eager = TorchDrafter(load_draft_model(dirs[1], TARGET), embed, lm_head)
    eager.add("s", torch.zeros(3, FEATURES))
    assert eager.propose([], []).shape == (0, BLOCK - 1)
    with pytest.raises(DrafterStateError, match="already added"):
        eager.add("s", torch.zeros(3, FEATURES))
    with pytest.raises(DrafterStateError, match="unknown sequence 'x'"):
        eager.propose(["x"], [1])
    with pytest.raises(DrafterStateError, match="got 2 feature rows, expected 3"):
        eager.commit(["s"], [2], [torch.zeros(2, FEATURES)])
    with pytest.raises(DrafterStateError, match=r"shape \(1, 5\), expected \[rows, 128\]"):
        eager.commit(["s"], [0], [torch.zeros(1, 5)])
    with pytest.raises(DrafterStateError, match="accepted count 8 outside"):
        eager.commit(["s"], [BLOCK], [torch.zeros(BLOCK + 1, FEATURES)])
    assert eager.committed_len("s") == 3  # failed commits changed nothing


def test_greedy_drafts_are_the_argmax_and_its_probability():
    """The drafter's two-reduction argmax equals jnp.argmax (first maximum on ties, first NaN of a
    row with one, -inf / +inf rows) and its confidence is the softmax's probability of it."""
    import jax.numpy as jnp

    from torchax_proposer.jax_drafter import greedy_drafts

    rng = np.random.default_rng(5)
    logits = rng.integers(-3, 4, (2, 6, 300)).astype(np.float32)  # many ties
    logits[0, 1] = -np.inf
    logits[0, 1, 7] = 0.0
    logits[0, 2, 150] = np.inf
    logits[0, 3, [40, 9]] = np.nan
    logits[1] = rng.standard_normal((6, 300)) * 4
    tokens, confidence = jax.jit(greedy_drafts)(jnp.asarray(logits))
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, axis=-1))
    finite = np.isfinite(logits).all(-1)
    expected = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1)).max(-1)
    np.testing.assert_allclose(np.asarray(confidence)[finite], expected[finite], rtol=1e-6)


def test_commit_block_drops_the_rows_of_requests_without_drafter_state(dirs, target_head):
    """A verify batch may hold requests the drafter does not serve (the adaptive worker's requests
    without drafter context): commit_block takes None for them, and their rows land nowhere.
    The served sequence's state equals a fresh proposer's with only its own rows."""
    rng = np.random.default_rng(8)
    proposer = make_proposer(dirs, target_head, max_num_seqs=2)
    prompt = rows(rng, 6)
    proposer.add("a", prompt)
    parts = [prompt]
    for accepted in ([0, 2, 0], [0, 0, 1], [0, 3, 0]):
        block = jax.device_put(rng.standard_normal((4, BLOCK, FEATURES), dtype=np.float32))
        proposer.commit_block([None, "a", None], accepted, block)  # row 3: the runner's padding
        parts.append(np.asarray(block[1, : accepted[1] + 1]))
    fresh = make_proposer(dirs, target_head)
    fresh.add("a", np.concatenate(parts))
    assert proposer.committed_len("a") == fresh.committed_len("a") == 6 + 3 + 1 + 4
    np.testing.assert_array_equal(proposer.propose(["a"], [5]), fresh.propose(["a"], [5]))
    assert_same_state(proposer, "a", fresh, "a")
    with pytest.raises(DrafterStateError, match="2 ids, 3 accepted counts"):
        proposer.commit_block([None, "a"], [0, 0, 0], block)


def test_a_few_row_matmul_kernel_drafts_what_the_eager_drafter_does(dirs, target_head):
    """`few_row_matmul` (sgl_dflash hands the proposer the target's CPU matmul kernel): every
    few-row projection of the traced drafter goes through it, and drafts and logits still equal
    the eager torch drafter's, step after step."""
    from jax_backend import cpu_kernels  # the package imports no kernels; the caller chooses one

    assert cpu_kernels.available()
    shapes = []

    def kernel(x, w):
        shapes.append((x.shape, w.shape))
        return cpu_kernels.rows_matmul(x, w)

    rng = np.random.default_rng(12)
    embed, lm_head = target_head
    proposer = make_proposer(dirs, target_head, few_row_matmul=kernel)
    eager = TorchDrafter(load_draft_model(dirs[1], TARGET), torch.from_numpy(embed), torch.from_numpy(lm_head))
    for seq, n in zip((0, 1), (5, 30)):
        prompt = rows(rng, n)
        proposer.add(seq, prompt)
        eager.add(seq, torch.tensor(np.asarray(prompt)))
    for step in range(3):
        bonus = rng.integers(0, 256, 2)
        tokens, logits = proposer.propose([0, 1], bonus, return_logits=True)
        eager_tokens, eager_logits = eager.propose([0, 1], bonus.tolist(), return_logits=True)
        np.testing.assert_allclose(logits, eager_logits.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(tokens, eager_tokens.numpy())
        accepted = rng.integers(0, BLOCK, 2)
        new_rows = [rows(rng, a + 1) for a in accepted]
        proposer.commit([0, 1], accepted, new_rows)
        eager.commit([0, 1], accepted.tolist(), [torch.tensor(np.asarray(r)) for r in new_rows])
    assert (((2 * (BLOCK - 1), 64), (256, 64))) in shapes  # the lm_head of the block's drafts
    assert len({w for _, w in shapes}) >= 4  # and the layers' projections


def test_a_draft_reads_the_cached_window_without_transposing_it(dirs, target_head):
    """The caches are head-major [slots, kv_heads, rows, D] and the CPU attention takes the keys
    as its scores' left operand: the compiled draft program writes no key window transposed
    ([.., D, rows]), which XLA:CPU did per layer at ~4 ns an element (docs/performance.md)."""
    proposer = make_proposer(dirs, target_head)
    proposer.add("a", rows(np.random.default_rng(0), 100))
    config = proposer.config
    assert proposer.k_cache[0].shape == (4, config.num_key_value_heads, 385, config.head_dim)
    jit, _ = proposer._draft_jit(None)
    _, inputs, statics = proposer._draft_batch(["a"], [3])
    text = jit.draft.lower(proposer.params, proposer.embed, proposer.lm_head, proposer.k_cache, proposer.v_cache,
                           *inputs, proposer.token_map, **statics).compile().as_text()
    window = statics["read_len"] + BLOCK  # the cached rows and the block's own keys
    transposed = re.compile(rf"f32\[[0-9,]*{config.head_dim},{window}\]")
    assert f",{window},{config.head_dim}]" in text  # the window is there, head-major
    assert not transposed.search(text), transposed.search(text).group(0)
