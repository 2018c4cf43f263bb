"""TargetRunner: mixed ragged batches, rollback, greedy decoding and compile counts against
transformers on a tiny random Qwen3 checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import jax
from jax import monitoring

from jax_backend import (
    BatchError,
    ContextLengthError,
    OutOfPages,
    SeqInput,
    TargetRunner,
)
from jax_backend import compiled_memory, sampling
from jax_backend.layout_tuner import AUTO_SWITCH_SEQS, EXPLORE_ROOM, LayoutTuner
from tests.jax_backend.allocator_utils import truncate
from tests.tiny_checkpoints import load_hf_model, make_tiny_target

TOL = 1e-4
AUX = (1, 2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("runner"), "qwen3")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def runner(checkpoint):
    return TargetRunner(checkpoint, page_size=8, max_total_tokens=512, max_num_seqs=8, aux_layer_ids=AUX)


def _hf_run(hf, ids):
    """transformers logits [n, V] and the aux features [n, len(AUX) * H] for a full sequence."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    aux = np.concatenate([out.hidden_states[l + 1][0].numpy() for l in AUX], axis=-1)
    return out.logits[0].numpy(), aux


def _ids(seed, n, vocab=256):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def test_mixed_batch_matches_transformers(runner, hf):
    """One forward holding a prefill (longer than one 256-token attention chunk), a 1-token
    decode and a 16-token verify block."""
    a, b, c = _ids(10, 270), _ids(11, 31), _ids(12, 34)
    alloc = runner.allocator
    tables = {name: alloc.allocate(name, len(ids)) for name, ids in (("a", a), ("b", b), ("c", c))}
    runner.forward([SeqInput(b[:30], 0, tables["b"]), SeqInput(c[:18], 0, tables["c"])])
    out = runner.forward(
        [
            SeqInput(a, 0, tables["a"], logits="all"),
            SeqInput(b[30:], 30, tables["b"], logits="all"),
            SeqInput(c[18:], 18, tables["c"], logits="all"),
        ]
    )
    for ids, start, logits, aux in zip((a, b, c), (0, 30, 18), out.logits, out.aux_hidden):
        ref_logits, ref_aux = _hf_run(hf, ids)
        assert logits.shape == (len(ids) - start, hf.config.vocab_size)
        np.testing.assert_allclose(logits, ref_logits[start:], atol=TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(aux), ref_aux[start:], atol=TOL, rtol=0)
    for name in tables:
        alloc.free(name)


def test_prefill_of_one_long_and_short_prompts_matches_transformers(runner, hf):
    """A prefill batch whose longest prompt dwarfs the others runs its attention in query tiles
    of packed rows (`choose_query_tile`), not in dense blocks of the longest prompt's size."""
    prompts = [_ids(20, 200), _ids(21, 20), _ids(22, 17), _ids(23, 23)]
    tables = [runner.allocator.allocate(i, len(ids)) for i, ids in enumerate(prompts)]
    seqs = [SeqInput(ids, 0, table, logits="all") for ids, table in zip(prompts, tables)]
    batch = runner._batch(seqs, fine_tokens=True)[0]
    assert batch.tokens.shape == (320,) and batch.max_q_len == 256 and batch.query_tile == 64
    assert runner._batch(seqs, query_tiles=False)[0].query_tile == 0
    out = runner.forward(seqs)
    for ids, logits, aux in zip(prompts, out.logits, out.aux_hidden):
        ref_logits, ref_aux = _hf_run(hf, ids)
        np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(aux), ref_aux, atol=TOL, rtol=0)
    before = runner.forward(seqs, fine_tokens=False, query_tiles=False)  # the layout bench_prefill compares
    for new, old in zip(out.logits, before.logits):
        np.testing.assert_allclose(new, old, atol=TOL, rtol=0)
    for i in range(len(prompts)):
        runner.allocator.free(i)


def test_long_prefix_steps_visit_only_the_chunks_they_need_and_match_transformers(checkpoint, hf):
    """On CPU a step's attention stops after the 256-token chunks its longest cached prefix
    needs (600 tokens: 3 of the 1,024-token window's 4): a decode and a verify block beside it
    still give transformers' logits, and the same step visiting every chunk agrees."""
    runner = TargetRunner(checkpoint, page_size=8, max_total_tokens=2048, max_num_seqs=4, aux_layer_ids=AUX)
    a, b = _ids(60, 601), _ids(61, 56)
    tables = {name: runner.allocator.allocate(name, len(ids)) for name, ids in (("a", a), ("b", b))}
    runner.forward([SeqInput(a[:600], 0, tables["a"]), SeqInput(b[:40], 0, tables["b"])])
    seqs = [SeqInput(a[600:], 600, tables["a"], logits="all"), SeqInput(b[40:], 40, tables["b"], logits="all")]
    batch = runner._batch(seqs)[0]
    assert batch.loop_to_longest and batch.page_indices.shape[1] * runner.page_size == 1024
    out = runner.forward(seqs)
    for ids, start, logits in zip((a, b), (600, 40), out.logits):
        np.testing.assert_allclose(logits, _hf_run(hf, ids)[0][start:], atol=TOL, rtol=0)
    runner._loop_to_longest = False  # the same step over all 4 chunks (the accelerator path)
    for every, stopped in zip(runner.forward(seqs).logits, out.logits):
        np.testing.assert_allclose(every, stopped, atol=1e-6, rtol=0)


def test_sample_without_features_computes_none(runner, monkeypatch):
    """`sample(features=False)` (a step whose caller reads only tokens: an adaptive worker's
    requests without drafter context): the same tokens, no features, the features' program never
    runs (~1 ms of a 60 ms step at 8 sequences) and the step captures no aux layers (NONE's
    program: capturing them cost ~2% of a decode step, docs/adaptive.md 2026-12-05)."""
    prompts = [_ids(43, 11), _ids(44, 6)]
    tables = [runner.allocator.allocate(10 + i, len(p) + 1) for i, p in enumerate(prompts)]
    runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    seqs = [SeqInput([9 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))]
    greedy = ([0.0] * 2, [1.0] * 2, [0] * 2)
    host = runner.sample(seqs, *greedy)
    assert len(host.features) == 2
    monkeypatch.setattr(runner, "hidden_state_features", lambda aux: pytest.fail("features computed"))
    bare = runner.sample(seqs, *greedy, features=False)  # rewrites the same K/V slots
    assert bare.tokens.tolist() == host.tokens.tolist() and bare.features == ()
    batch, _ = runner._batch(seqs)
    arrays = sampling.per_row_params(batch.logits_indices.shape[0], 1, *greedy)
    widths = {program: runner._sample_steps[program].lower(runner._step_params, runner.kv_pool, batch, *arrays, None)
              .out_info[1].shape[-1] for program in ("greedy", "greedy without aux")}
    assert widths == {"greedy": len(runner.aux_layer_ids) * runner.config.hidden_size, "greedy without aux": 0}
    for i in range(2):
        runner.allocator.free(10 + i)


def test_sample_can_leave_the_drafter_features_on_the_device(runner, hf, monkeypatch):
    """`sample(device_features=True)`: the same tokens, and the features of every sequence's
    token as rows of one device array (padding rows after them), equal to the host ones."""
    prompts = [_ids(40, 9), _ids(41, 14), _ids(42, 5)]
    tables = [runner.allocator.allocate(i, len(p) + 1) for i, p in enumerate(prompts)]
    runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    seqs = [SeqInput([7 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))]
    greedy = ([0.0] * 3, [1.0] * 3, [0] * 3)
    host = runner.sample(seqs, *greedy)
    device = runner.sample(seqs, *greedy, device_features=True)  # rewrites the same K/V slots
    assert device.tokens.tolist() == host.tokens.tolist() and device.features == ()
    assert device.device_features.shape == (4, host.features[0].shape[-1])
    np.testing.assert_allclose(np.asarray(device.device_features)[:3], np.concatenate(host.features), atol=1e-6, rtol=0)
    dispatched = runner.sample(seqs, *greedy, device_features=True, wait=False)  # tokens read later
    assert isinstance(dispatched.tokens, jax.Array) and np.asarray(dispatched.tokens)[:3].tolist() == host.tokens.tolist()
    with pytest.raises(BatchError, match="wait=False"):
        runner.sample(seqs, *greedy, wait=False)
    # a step not waited for is timed for the layer-loop tuner once the caller reports it read
    timed = []
    monkeypatch.setattr(runner._tuner, "observe", lambda key, loop, seconds: timed.append((key, loop)))
    runner.sample(seqs, *greedy, device_features=True, wait=False)  # never reported: not timed
    assert timed == []
    later = runner.sample(seqs, *greedy, device_features=True, wait=False)
    np.asarray(later.tokens)
    runner.step_read()
    runner.step_read()  # once per step
    key = runner._tuner.choose_loop("sample", runner._batch(seqs)[0], "greedy", timed=False)[1]
    assert [k for k, _ in timed] == [key] and timed[0][1] in ("scan", "switch")
    for i in range(len(prompts)):
        runner.allocator.free(i)


def test_rollback_equals_never_seeing_dropped_tokens(runner, hf):
    """Verify an 8-token block, keep its first 4 tokens, release the page holding only rejected
    tokens, then run a new block from the shorter start: logits equal a run that never saw the
    rejected tokens, although stale K/V of those tokens is still in the pages."""
    prompt, block, nxt = _ids(20, 20), _ids(21, 8), _ids(22, 8)
    alloc = runner.allocator
    table = alloc.allocate("r", len(prompt) + len(block))
    runner.forward([SeqInput(prompt, 0, table)])
    runner.forward([SeqInput(block, len(prompt), table, logits="all")])
    kept = prompt + block[:4]
    assert truncate(alloc, "r", len(kept)) == 1  # tokens 24..27 (rejected) had a page alone
    table = alloc.allocate("r", len(kept) + len(nxt))
    out = runner.forward([SeqInput(nxt, len(kept), table, logits="all")])
    ref_logits, ref_aux = _hf_run(hf, kept + nxt)
    np.testing.assert_allclose(out.logits[0], ref_logits[len(kept):], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out.aux_hidden[0]), ref_aux[len(kept):], atol=TOL, rtol=0)
    # Roll back further, into an earlier page: the freed page is handed out again, stale.
    assert truncate(alloc, "r", 14) == 2
    table = alloc.allocate("r", 14 + len(nxt))
    out = runner.forward([SeqInput(nxt, 14, table, logits="all")])
    ref_logits, _ = _hf_run(hf, prompt[:14] + nxt)
    np.testing.assert_allclose(out.logits[0], ref_logits[14:], atol=TOL, rtol=0)
    alloc.free("r")


def test_greedy_decode_matches_generate_without_recompiling(runner, hf):
    """Two sequences decode 50 tokens together (crossing page boundaries). After one warm-up
    step no new compilation happens anywhere in JAX, and both match transformers' greedy
    generate."""
    steps = 50
    prompts = [_ids(30, 11), _ids(31, 6)]
    alloc = runner.allocator
    tables = [alloc.allocate(i, len(p)) for i, p in enumerate(prompts)]
    out = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    tokens = [[int(l[0].argmax())] for l in out.logits]

    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event)  # noqa: E731
    monitoring.register_event_duration_secs_listener(listener)
    try:
        for step in range(steps):
            seqs = []
            for i, prompt in enumerate(prompts):
                pos = len(prompt) + len(tokens[i]) - 1
                seqs.append(SeqInput([tokens[i][-1]], pos, alloc.allocate(i, pos + 1)))
            out = runner.forward(seqs)
            for i, logits in enumerate(out.logits):
                tokens[i].append(int(logits[0].argmax()))
            if step == 0:  # warm-up: the decode bucket and the aux slice compile here
                assert "/jax/core/compile/backend_compile_duration" in compiles  # listener works
                compiles.clear()
                cache_size = runner.num_compilations()
    finally:
        monitoring.unregister_event_duration_listener(listener)
    backend_compiles = [e for e in compiles if e == "/jax/core/compile/backend_compile_duration"]
    assert backend_compiles == []
    assert runner.num_compilations() == cache_size

    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=steps + 1, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert tokens[i] == ref
        alloc.free(i)


def test_bad_requests_raise_clear_errors(checkpoint, runner):
    small = TargetRunner(checkpoint, page_size=8, max_total_tokens=256, max_model_len=32, max_num_seqs=2)
    assert small.max_model_len == 32
    table = small.allocator.allocate("x", 40)
    with pytest.raises(ContextLengthError, match="40 tokens .* exceed max_model_len 32"):
        small.forward([SeqInput(list(range(40)), 0, table)])
    with pytest.raises(ContextLengthError, match="exceed max_model_len 32"):
        small.forward([SeqInput([1, 2], 31, table)])
    with pytest.raises(BatchError, match=r"token ids must be in \[0, 256\)"):
        small.forward([SeqInput([1, 256], 0, table)])
    with pytest.raises(BatchError, match="exceed max_num_seqs 2"):
        small.forward([SeqInput([1], 0, table)] * 3)
    with pytest.raises(OutOfPages):
        small.allocator.allocate("y", 256)
    with pytest.raises(ValueError, match=r"aux_layer_ids \[4\] out of range"):
        TargetRunner(checkpoint, aux_layer_ids=(0, 4))
    # The shared runner's defaults: max_model_len = min(max_position_embeddings, pool size).
    assert runner.max_model_len == 512 and runner.page_size == 8
    assert runner.embed.shape == runner.lm_head.shape == (256, 64)


def test_no_aux_layers_returns_empty_tuple(checkpoint, hf):
    plain = TargetRunner(checkpoint, page_size=16, max_total_tokens=64)
    ids = _ids(40, 9)
    out = plain.forward([SeqInput(ids, 0, plain.allocator.allocate(0, 9))])
    assert out.aux_hidden == ()
    np.testing.assert_allclose(out.logits[0][0], _hf_run(hf, ids)[0][-1], atol=TOL, rtol=0)


def test_one_sequence_decodes_one_row_without_copying_the_pool(runner, hf):
    """A lone decode runs one token row (XLA:CPU's 1-row GEMV reads weights far faster than a
    2-row GEMM), its KV write stays an in-place scatter (no program copies the pool), and its
    greedy tokens are transformers'."""
    prompt, alloc = _ids(50, 9), runner.allocator
    out = runner.forward([SeqInput(prompt, 0, alloc.allocate("one", len(prompt)))])
    tokens = [int(out.logits[0][0].argmax())]
    for _ in range(8):
        pos = len(prompt) + len(tokens) - 1
        seq = SeqInput([tokens[-1]], pos, alloc.allocate("one", pos + 1))
        tokens.append(int(runner.sample([seq], [0.0], [1.0], [0]).tokens[0]))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert tokens == ref
    assert runner._batch([seq])[0].tokens.shape == (1,)
    assert not _pool_copies(runner, seq)
    alloc.free("one")


@pytest.mark.parametrize("loop", ["unrolled", "switch"])
def test_other_layer_loops_equal_the_scan_without_copying_the_pool(checkpoint, runner, loop):
    """Unrolled, XLA hoisted every layer's page gather ahead of the in-place KV write and copied
    the whole pool twice per step (14x slower on the real model); a data edge orders them. The
    switch layout reads each layer's weights where they lie: its program slices no stacked weight."""
    other = TargetRunner(checkpoint, page_size=8, max_total_tokens=512, max_num_seqs=8, aux_layer_ids=AUX,
                         layer_loop=loop)
    prompt = _ids(60, 20)
    outs = []
    for r in (runner, other):
        table = r.allocator.allocate("u", len(prompt) + 1)
        first = r.forward([SeqInput(prompt, 0, table)])
        outs.append(r.forward([SeqInput([int(first.logits[0][0].argmax())], len(prompt), table, "all")]))
        r.allocator.free("u")
    np.testing.assert_allclose(outs[1].logits[0], outs[0].logits[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(outs[1].aux_hidden[0]), np.asarray(outs[0].aux_hidden[0]), atol=TOL, rtol=0)
    seq = SeqInput([1, 2], len(prompt), other.allocator.allocate("u", 30))
    assert not _pool_copies(other, seq)  # (compiles the greedy sample step)
    assert not _stacked_weight_slices(other, seq)
    scan_seq = SeqInput([1, 2], len(prompt), runner.allocator.allocate("u", 30))
    assert not _pool_copies(runner, scan_seq) and _stacked_weight_slices(runner, scan_seq)
    runner.allocator.free("u")


def test_auto_layer_loop_tunes_decode_and_verify_steps(checkpoint):
    """layer_loop="auto" on a CPU: a decode step (`sample`, one token per sequence) or a verify
    step runs the scan or the switch layout, each timed on its shape and then the faster
    (`LayoutTuner`); until then decode steps of >= AUTO_SWITCH_SEQS sequences start on the switch
    (its program slices no stacked weight). Multi-token `sample` steps run the scan. Same
    tokens and features as the scan either way."""
    n = AUTO_SWITCH_SEQS
    runners = [TargetRunner(checkpoint, page_size=8, max_total_tokens=1024, max_num_seqs=n, aux_layer_ids=AUX,
                            layer_loop=loop) for loop in ("scan", "auto")]
    prompts = [_ids(70 + i, 3 + i % 5) for i in range(n)]
    outs = []
    for r in runners:
        tables = [r.allocator.allocate(i, len(p) + 1) for i, p in enumerate(prompts)]
        first = r.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
        decode = [SeqInput([int(f.argmax())], len(p), t) for f, p, t in zip(first.logits, prompts, tables)]
        outs.append([r.sample(decode[:m], [0.0] * m, [1.0] * m, [0] * m) for m in (n, 2) for _ in range(10)])
    scan, auto = runners
    for a, b in zip(*outs):  # 10 steps of 16 and of 2 sequences: both layouts ran each shape
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(np.concatenate(a.features), np.concatenate(b.features), atol=TOL, rtol=0)
    wide = [SeqInput([1], len(p), auto.allocator.page_table(i)) for i, p in enumerate(prompts)]
    for seqs, default in ((wide, "switch"), (wide[:2], "scan")):
        loop, key = auto._tuner.choose_loop("sample", auto._batch(seqs)[0], "greedy", timed=False)
        times = auto._tuner.times(key)
        assert len(times["scan"]) >= 3 and len(times["switch"]) >= 3  # 10 steps: 1 + 3 each, then the faster
        assert loop == auto._tuner.best(key) == min(times, key=lambda layout: np.median(times[layout]))
        assert LayoutTuner().choose_loop("sample", auto._batch(seqs)[0], "greedy", timed=False)[0] == default
    assert not _stacked_weight_slices(auto, wide, "switch") and _stacked_weight_slices(auto, wide, "scan")
    two_tokens = [SeqInput([1, 2], len(p) - 1, auto.allocator.page_table(i)) for i, p in enumerate(prompts)]
    ragged = two_tokens[:4] + wide[4:12]  # as many rows as sequence slots (16), but a verify block
    assert auto._batch(ragged)[0].tokens.shape[0] == auto._batch(ragged)[0].kv_lens.shape[0] == n
    for seqs in (two_tokens, ragged):
        assert auto._tuner.choose_loop("sample", auto._batch(seqs)[0], "greedy", timed=True) == ("scan", None)
    # verify steps are tuned too: 10 verifies of two 3-token blocks, the same as the scan's each time
    blocks = [[SeqInput([5, 6, 7], len(p), r.allocator.page_table(i), "all") for i, p in enumerate(prompts[:2])]
              for r in runners]
    for _ in range(10):
        a, b = scan.verify(blocks[0]), auto.verify(blocks[1])
        np.testing.assert_array_equal(a.accepted, b.accepted)
        np.testing.assert_array_equal(a.bonus, b.bonus)
    key = auto._tuner.choose_loop("verify", auto._batch(blocks[1])[0], "greedy", timed=False, block=3)[1]
    assert all(len(t) >= 3 for t in auto._tuner.times(key).values())
    assert _stacked_weight_slices(scan, wide, "switch")  # a scan runner has no other layout
    layer_bytes = sum(w.nbytes for w in scan.params["layers"].values())
    assert sum(auto.memory_per_device()["weights"].values()) == sum(scan.memory_per_device()["weights"].values()) + layer_bytes


def test_near_the_mapping_limit_a_new_shape_compiles_one_layout(checkpoint, monkeypatch):
    """Each layout of a shape is its own compiled program, and Linux caps a process's memory
    mappings (`compiled_memory`): with room for fewer than EXPLORE_ROOM more programs, a decode
    shape met for the first time compiles and runs only its default layout, for good; with room,
    both (a benchmark process of five engines died of the second layouts, 2026-11-29)."""
    runner = TargetRunner(checkpoint, page_size=8, max_total_tokens=512, max_num_seqs=4, aux_layer_ids=AUX)
    prompts = [_ids(90 + i, 4 + i) for i in range(4)]
    tables = [runner.allocator.allocate(i, len(p) + 12) for i, p in enumerate(prompts)]
    runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    greedy = runner._sample_steps.get("greedy")
    for m, room, programs in ((1, EXPLORE_ROOM - 1, 1), (3, EXPLORE_ROOM, 2)):
        monkeypatch.setattr(compiled_memory, "program_room", lambda room=room: room)
        seqs = [SeqInput([1], len(p), t) for p, t in zip(prompts[:m], tables[:m])]
        before = greedy._cache_size() if greedy else 0
        outs = [runner.sample(seqs, [0.0] * m, [1.0] * m, [0] * m).tokens for _ in range(8)]
        greedy = runner._sample_steps["greedy"]
        assert greedy._cache_size() - before == programs
        loop, key = runner._tuner.choose_loop("sample", runner._batch(seqs)[0], "greedy", timed=True)
        times = runner._tuner.times(key)
        if programs == 1:  # settled: the scan (the default below AUTO_SWITCH_SEQS) on every step, nothing timed
            assert loop == "scan" and runner._tuner.uncompiled(key, "scan") == [] and not times["switch"]
        else:
            assert len(times["scan"]) >= 3 and len(times["switch"]) >= 3
        assert all(np.array_equal(o, outs[0]) for o in outs)  # same context each step: same tokens


def test_verify_steps_past_tuned_verify_seqs_run_the_scan_alone(checkpoint):
    """`tuned_verify_seqs` (the adaptive worker's TUNED_VERIFY_SEQS): verify steps of up to that
    many sequences (the padded batch) compile and time both layer loops, larger ones compile and
    run the scan only, one program per shape; the same accept counts and tokens either way."""
    runner = TargetRunner(checkpoint, page_size=8, max_total_tokens=512, max_num_seqs=4, aux_layer_ids=AUX)
    runner.tuned_verify_seqs = 2
    prompts = [_ids(40 + i, 4 + i) for i in range(3)]
    tables = [runner.allocator.allocate(i, len(p) + 12) for i, p in enumerate(prompts)]
    runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    for m, programs in ((2, 2), (3, 1)):  # 3 sequences pad to 4
        seqs = [SeqInput([5, 6, 7], len(p), t, "all") for p, t in zip(prompts[:m], tables[:m])]
        before = runner._verify_steps["greedy"]._cache_size() if "greedy" in runner._verify_steps else 0
        outs = [runner.verify(seqs) for _ in range(8)]
        assert runner._verify_steps["greedy"]._cache_size() - before == programs
        key = runner._tuner.choose_loop("verify", runner._batch(seqs)[0], "greedy", timed=False, block=3)[1]
        times = runner._tuner.times(key)
        if programs == 2:
            assert len(times["scan"]) >= 3 and len(times["switch"]) >= 3
        else:
            assert not times["scan"] and not times["switch"]
        for out in outs[1:]:  # same context each step: same outcome
            np.testing.assert_array_equal(out.accepted, outs[0].accepted)
            np.testing.assert_array_equal(out.bonus, outs[0].bonus)


def _stacked_weight_slices(runner, seqs, loop: str | None = None) -> list[str]:
    """Lines of the greedy sample program with `loop`'s weights (default: the runner's own
    layout), before XLA's passes, that slice a layer out of a stacked [num_layers, ...] weight
    (the scan's per-step weight reads; XLA:CPU copies them)."""
    seqs = seqs if isinstance(seqs, list) else [seqs]
    runner.sample(seqs, [0.0] * len(seqs), [1.0] * len(seqs), [0] * len(seqs))  # builds the greedy sample step
    batch, _ = runner._batch(seqs)
    greedy = sampling.per_row_params(batch.kv_lens.shape[0], 1, [0.0], [1.0], [0])
    fn = runner._sample_steps["greedy"]
    params = runner._switch_params if loop == "switch" else runner._step_params
    text = fn.lower(params, runner.kv_pool, batch, *greedy, None).as_text()
    stacked = {f"tensor<{runner.config.num_hidden_layers}x{'x'.join(map(str, w.shape[1:]))}xf32>"
               for w in runner.params["layers"].values()}
    return [line.strip()[:160] for line in text.splitlines()
            if "dynamic_slice" in line and any(f"({t}" in line or f"{t}," in line for t in stacked)]


def _pool_copies(runner, seq) -> list[str]:
    """Lines of the greedy sample program (for `seq` alone) that copy an array of the pool's size."""
    runner.sample([seq], [0.0], [1.0], [0])  # compiles the greedy sample step
    batch, _ = runner._batch([seq])
    greedy = (np.zeros(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32))
    hlo = runner._sample_steps["greedy"].lower(runner._step_params, runner.kv_pool, batch, *greedy, None)
    return [line.strip()[:120] for line in hlo.compile().as_text().splitlines()
            if " copy(" in line and _elements(line.split("=")[1]) == runner.kv_pool.size]


def _elements(hlo_type: str) -> int:
    """Element count of the first array type in an HLO result, e.g. 'f32[4,8,2]{...} copy(...)'."""
    dims = hlo_type.strip().split("[", 1)[1].split("]", 1)[0]
    return int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1


@pytest.mark.parametrize("dtype, precision", [("float32", "HIGHEST"), ("bfloat16", "DEFAULT")])
def test_float32_steps_run_their_matmuls_at_full_precision(checkpoint, dtype, precision):
    """float32 is the exact-output configuration: its matmuls ask for full precision, because a
    GPU's default (TF32) made greedy DFLASH part from greedy NONE on an H100; bfloat16 keeps the
    backend's default."""
    r = TargetRunner(checkpoint, dtype=dtype, page_size=8, max_total_tokens=64, max_num_seqs=2)
    seq = SeqInput([1, 2, 3], 0, r.allocator.allocate("p", 4))
    batch, _ = r._batch([seq])
    greedy = (np.zeros(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32))
    r.sample([seq], [0.0], [1.0], [0])  # builds the greedy sample step
    text = r._sample_steps["greedy"].lower(r._step_params, r.kv_pool, batch, *greedy, None).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all(f"precision = [{precision}, {precision}]" in line for line in dots), dots[:3]
