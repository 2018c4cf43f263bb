"""DFlash drafter training: the kept response set, loop trimming, blocks and labels from the target's
prefill, the block attention mask, resumable training, and a tiny end-to-end run whose drafter is
measured with the z-lab reference `dflash_generate` (real spec decoding)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sgl_dflash.tools.train import batches, core, trainer
from sgl_dflash.tools.train.responses import Response, ResponseSet, ResponseSetError
from tests.tiny_checkpoints import load_hf_model, make_tiny_target

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

BLOCK = 8


# -- the recipe's pieces --------------------------------------------------------------------------
def test_block_attention_mask_sees_strictly_earlier_context_and_own_block():
    anchors = torch.tensor([[3, 6]])
    mask = core.block_attention_mask(8, anchors, block_size=2)[0, 0]
    assert mask.shape == (4, 8 + 4)
    ctx, blocks = mask[:, :8], mask[:, 8:]
    assert ctx[0].tolist() == [True] * 3 + [False] * 5  # positions < 3, not the anchor itself
    assert ctx[1].tolist() == ctx[0].tolist()
    assert ctx[2].tolist() == [True] * 6 + [False] * 2
    assert blocks.tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


def test_loss_weights_follow_the_paper_decay():
    w = core.loss_weights(16)
    assert w.shape == (15,)
    assert torch.allclose(w, torch.exp(-torch.arange(15.0) / 7.0))
    assert core.loss_gamma(8) == 4.0 and core.loss_gamma(10) == 5.0


def test_lr_schedule_warms_up_then_decays_to_zero():
    lrs = [core.lr_at(s, 100, 1.0) for s in range(100)]
    assert lrs[0] == pytest.approx(0.25) and lrs[3] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] < 0.01


def test_loop_tails_are_found_and_cut_after_three_periods():
    text = np.arange(100, 200)
    loop = np.tile([7, 8, 9, 10, 11], 40)  # period 5, 200 tokens
    tokens = np.concatenate([text, loop])
    assert batches.loop_start(tokens) == (100, 5)
    assert batches.loop_start(text) is None and batches.loop_start(loop[:50]) is None  # short: no verdict
    row = Response("x", "s", np.array([1, 2, 3]), tokens, "length", "greedy")
    seq = batches.to_train_sequence(row, trim_loops=True, max_seq_len=10_000)
    assert seq.response_start == 3 and len(seq.tokens) == 3 + 100 + 15
    assert len(batches.to_train_sequence(row, trim_loops=False, max_seq_len=10_000).tokens) == 303
    assert len(batches.to_train_sequence(row, trim_loops=False, max_seq_len=50).tokens) == 50


def test_blocks_label_the_targets_greedy_tokens_while_the_text_agrees():
    # One sequence: prompt of 2, response of 8. The target's argmax agrees with the text except
    # at position 6 (it would have said 99 instead of the sampled 6).
    tokens = torch.arange(10)[None]
    next_ids = torch.arange(1, 11)[None].clone()  # argmax at p predicts token p+1 ...
    next_ids[0, 5] = 99  # ... except at p=5: the target's token at position 6 is 99
    seq = batches.TrainSequence("s", tokens[0].numpy(), 2, greedy=False)
    blocks = batches.make_blocks([seq], tokens, torch.zeros(1, 10, 4), next_ids, block_size=4, max_anchors=100,
                                 rng=None)
    assert blocks.anchors[0].tolist() == list(range(2, 9))  # every response position with a next token
    by_anchor = {a: (blocks.labels[0, j].tolist(), blocks.label_mask[0, j].tolist())
                 for j, a in enumerate(blocks.anchors[0].tolist())}
    assert by_anchor[2] == ([3, 4, 5], [1, 1, 1])
    # Anchor 4: offset 2 is the target's 99 (supervised, the text agreed up to it); offset 3 is not
    # supervised, because the text (6) left the target's greedy path at offset 2.
    assert by_anchor[4] == ([5, 99, 7], [1, 1, 0])
    assert by_anchor[8][1] == [1, 0, 0]  # past the end of the sequence
    full = batches.make_blocks([seq], tokens, torch.zeros(1, 10, 4), next_ids, block_size=4, max_anchors=100,
                               rng=None, full_blocks_only=True)
    assert full.anchors[0].tolist() == list(range(2, 7))
    sampled = batches.make_blocks([seq], tokens, torch.zeros(1, 10, 4), next_ids, block_size=4, max_anchors=3,
                                  rng=np.random.default_rng(0))
    assert len(set(sampled.anchors[0].tolist())) == 3


# -- the kept response set ------------------------------------------------------------------------
def _rows(ids, n_out=5, big=False):
    top = 70_000 if big else 1000
    return [{"id": i, "source": "math" if k % 2 else "sharegpt", "prompt_ids": [1, 2, k],
             "output_ids": list(range(top - n_out - k, top - k)), "finish": "stop" if k % 2 else "length"}
            for k, i in enumerate(ids)]


def test_response_set_round_trip_never_stores_a_prompt_twice(tmp_path):
    target = {"name": "t", "checksum": "sha256:abc"}
    rs = ResponseSet.open(tmp_path / "set", target)
    assert rs.append(_rows(["a", "b", "a"]), sampling="greedy", generated_by="test") == 2
    assert rs.append(_rows(["b", "c"]), sampling="greedy", generated_by="test") == 1  # b is kept once
    assert rs.append(_rows(["b"]), sampling="temperature 1, top_p 1", generated_by="test") == 1  # other sampling
    assert rs.append(_rows(["d"], big=True), sampling="greedy", generated_by="test") == 1  # ids >= 2**16
    assert rs.append(_rows(["a"]), sampling="greedy", generated_by="test") == 0
    loaded = ResponseSet.load(tmp_path / "set")
    assert [r.id for r in loaded] == ["a", "b", "c", "b", "d"]
    assert loaded.has("b", "greedy") and not loaded.has("c", "temperature 1, top_p 1")
    assert loaded.rows[4].output_ids.max() == 69_999 and loaded.rows[2].prompt_ids.tolist() == [1, 2, 1]
    assert [r.greedy for r in loaded] == [True, True, True, False, True]
    assert len(ResponseSet.load(tmp_path / "set", sampling="greedy")) == 4
    totals = loaded.manifest["totals"]
    assert totals["responses"] == 5 and totals["response_tokens"] == 25 and totals["shards"] == 4
    assert loaded.manifest["shards"][0]["finish"] == {"length": 1, "stop": 1}
    assert loaded.used_token_ids() == sorted({t for r in loaded for t in r.output_ids.tolist()})

    with pytest.raises(ResponseSetError, match="checksum"):
        ResponseSet.open(tmp_path / "set", {"name": "t", "checksum": "sha256:other"})
    with pytest.raises(ResponseSetError, match="'output_ids'"):
        rs.append([{"id": "e", "source": "s", "prompt_ids": [1], "finish": "stop"}], sampling="greedy",
                  generated_by="test")
    with pytest.raises(ResponseSetError, match="finish"):
        rs.append([{**_rows(["e"])[0], "finish": "eos"}], sampling="greedy", generated_by="test")
    with pytest.raises(ResponseSetError, match="no manifest"):
        ResponseSet.load(tmp_path)
    (tmp_path / "set" / "shard-00001.npz").unlink()
    with pytest.raises(ResponseSetError, match="shard-00001.npz"):
        ResponseSet.load(tmp_path / "set")


def test_token_map_keeps_the_most_frequent_ids(tmp_path):
    rs = ResponseSet.open(tmp_path / "set", {"name": "t", "checksum": "sha256:abc"})
    rows = [{"id": f"r{i}", "source": "s", "prompt_ids": [1], "output_ids": out, "finish": "stop"}
            for i, out in enumerate([[7, 7, 7, 3], [3, 3, 9, 5], [5, 11]])]  # 3: 3x, 7: 3x, 5: 2x, 9/11: 1x
    rs.append(rows, sampling="greedy", generated_by="test")
    assert rs.used_token_ids() == [3, 5, 7, 9, 11]
    assert rs.used_token_ids(max_ids=2) == [3, 7]
    assert rs.used_token_ids(max_ids=4) == [3, 5, 7, 9]  # ties: the smaller id first
    assert rs.used_token_ids(max_ids=100) == [3, 5, 7, 9, 11]
    assert rs.token_counts()[[3, 7, 5, 9, 0]].tolist() == [3, 3, 2, 1, 0]
    with pytest.raises(ResponseSetError, match="max_ids"):
        rs.used_token_ids(max_ids=0)


def test_holdout_split_is_stable_when_the_set_grows():
    def rows(n):
        return [Response(f"id{i}", "s", np.array([1]), np.array([2, 3]), "stop", "greedy") for i in range(n)]

    _, held_small = batches.split_holdout(rows(200), 8)
    train_big, held_big = batches.split_holdout(rows(200) + [Response("id5", "s", np.array([1]), np.array([4]),
                                                                      "stop", "temperature 1, top_p 1")], 8)
    # Growing the set can only move a held-out prompt out of the top 8, never shuffle the rest in.
    assert {r.id for r in held_small} == {r.id for r in held_big} and len(held_big) == 8
    assert not {r.id for r in train_big} & {r.id for r in held_big}  # sampled rows of held prompts too
    # A later turn of a conversation never displaces a first turn from the held-out set, and a
    # later turn of a held-out conversation (its prompt shows the held-out answer) is not trained on.
    turns = [Response(f"id{i}/turn2", "s2", np.array([1]), np.array([2]), "stop", "greedy") for i in range(200)]
    train_turns, held_turns = batches.split_holdout(rows(200) + turns, 8)
    assert [r.id for r in held_turns] == [r.id for r in held_small]
    assert {r.id for r in train_turns} == {r.id for r in rows(200) + turns} - {r.id for r in held_small} - {
        f"{r.id}/turn2" for r in held_small}


def test_the_kept_smollm2_set_is_complete():
    from sgl_dflash.tools.train.responses import default_set_dir

    path = default_set_dir("SmolLM2-135M-Instruct")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["totals"]["response_tokens"] >= 2_000_000
    assert manifest["totals"]["by_sampling"]["greedy"]["responses"] >= 13_000
    assert any(c["checked"] >= 16 and c["identical"] == c["checked"] for c in manifest.get("checks", []))
    for shard in manifest["shards"]:
        assert (path / shard["file"]).is_file(), shard["file"]


# -- training -------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls gain nothing from a second thread, and on a busy 2-core machine the idle one
    spin-waits; restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("target"), "llama", vocab_size=128,
                            hidden_size=64, num_hidden_layers=4, initializer_range=0.1)


def greedy_sequences(target_dir, num, prompt_len, new_tokens, seed):
    model = load_hf_model(target_dir)
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 120, (num, prompt_len), generator=gen)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return prompts, out


def reference_tau(draft_dir, target_dir, prompts, new_tokens):
    """Mean accepted length of z-lab's own greedy DFlash loop with this drafter."""
    import dflash.model
    from dflash.model import DFlashDraftModel, dflash_generate

    # Its stats timer calls torch.cuda.synchronize(); this machine has no CUDA.
    dflash.model._cuda_time = time.perf_counter

    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    target = load_hf_model(target_dir)
    lengths = []
    for p in prompts:
        stats = dflash_generate(draft, target, p[None], new_tokens, None, return_stats=True)
        lengths += stats.acceptance_lengths
    return float(np.mean(lengths))


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    _, seqs = greedy_sequences(tiny_target, 48, 8, 40, seed=0)
    out = tmp_path_factory.mktemp("draft")
    log = trainer.train_drafter(tiny_target, out, seqs.tolist(), prompt_lens=[8] * len(seqs), num_layers=1,
                                block_size=BLOCK, steps=150, batch_size=8, num_anchors=16, lr=3e-3, seed=0,
                                progress=False)
    untrained = tmp_path_factory.mktemp("untrained")
    trainer.train_drafter(tiny_target, untrained, seqs.tolist(), prompt_lens=[8] * len(seqs), num_layers=1,
                          block_size=BLOCK, steps=0, seed=0, progress=False)
    return out, log, untrained


@pytest.mark.slow
def test_training_loss_decreases(trained):
    _, log, _ = trained
    losses = [r["loss"] for r in log["log"]]
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert len(losses) == 150 and last < 0.6 * first, (first, last)


@pytest.mark.slow
def test_checkpoint_is_zlab_format(trained, tiny_target):
    out, _, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["block_size"] == BLOCK
    assert config["dflash_config"]["target_layer_ids"] == [2]
    assert config["training"]["target"] == Path(tiny_target).name
    assert config["training"]["recipe"]["lr"] == 3e-3 and config["training"]["steps_done"] == 150
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith(("model.", "embed", "lm_head")) for n in names)


@pytest.mark.slow
def test_trained_drafter_is_accepted_more_than_random(trained, tiny_target):
    out, _, untrained = trained
    held_out = torch.randint(3, 120, (4, 8), generator=torch.Generator().manual_seed(123))
    tau_trained = reference_tau(out, tiny_target, held_out, 32)
    tau_random = reference_tau(untrained, tiny_target, held_out, 32)
    print(f"tau trained {tau_trained:.2f} random {tau_random:.2f}")
    assert tau_trained > tau_random + 0.5, (tau_trained, tau_random)


@pytest.mark.slow
def test_teacher_forced_tau_matches_the_reference_loop(trained, tiny_target, tmp_path):
    """`evaluate` (all anchors of a greedy text, teacher-forced) is the acceptance the real loop
    sees: on the reference's own greedy outputs its tau lies close to dflash_generate's."""
    out, _, _ = trained
    prompts, seqs = greedy_sequences(tiny_target, 6, 8, 48, seed=7)
    rows = [Response(f"p{i}", "s", s[:8].numpy(), s[8:].numpy(), "length", "greedy") for i, s in enumerate(seqs)]
    result = trainer.evaluate_checkpoint(tiny_target, rows, out, [BLOCK], holdout=6, trim_loops=False, device="cpu")
    tau_ref = reference_tau(out, tiny_target, prompts, 48)
    assert result[f"B{BLOCK}"]["sequences"] == 6
    assert abs(result[f"B{BLOCK}"]["tau"] - tau_ref) < 0.35 * tau_ref, (result, tau_ref)


@pytest.mark.slow
def test_held_out_tau_under_a_token_map(trained, tiny_target):
    """Drafting over a hot-token map: a map of every id changes nothing; a map holding every label
    can only turn wrong drafts right; a map without the labels accepts nothing."""
    out, _, _ = trained
    _, seqs = greedy_sequences(tiny_target, 6, 8, 48, seed=7)
    rows = [Response(f"p{i}", "s", s[:8].numpy(), s[8:].numpy(), "length", "greedy") for i, s in enumerate(seqs)]
    vocab = json.loads((Path(tiny_target) / "config.json").read_text())["vocab_size"]
    labels = sorted({t for r in rows for t in r.output_ids.tolist()})

    def tau(token_map):
        result = trainer.evaluate_checkpoint(tiny_target, rows, out, [BLOCK], holdout=6, trim_loops=False,
                                             device="cpu", token_map=token_map)[f"B{BLOCK}"]
        return result["tau"], result["accuracy_per_position"]

    full, full_accuracy = tau(None)
    assert tau(list(range(vocab))) == (full, full_accuracy)
    hot, hot_accuracy = tau(labels)
    assert hot >= full and all(h >= f for h, f in zip(hot_accuracy, full_accuracy))
    assert tau(sorted(set(range(vocab)) - set(labels)))[0] == 1.0


@pytest.mark.slow
def test_training_resumes_exactly_and_reports_held_out_tau(tiny_target, tmp_path):
    """An interrupted run resumed from train_state.pt ends with the same weights as an uninterrupted
    one; the final checkpoint records the held-out teacher-forced tau."""
    from safetensors.torch import load_file

    _, seqs = greedy_sequences(tiny_target, 24, 6, 24, seed=3)
    rows = [Response(f"p{i}", "s", s[:6].numpy(), s[6:].numpy(), "length", "greedy") for i, s in enumerate(seqs)]
    cfg = trainer.TrainConfig(num_layers=1, block_size=4, num_feature_layers=2, max_anchors=8, tokens_per_batch=120,
                              steps=6, lr=1e-3, holdout=4, save_every_s=0.0, feature_noise=0.05)
    full = trainer.train(tiny_target, rows, tmp_path / "full", cfg, device="cpu", progress=False)
    trainer.train(tiny_target, rows, tmp_path / "resumed", cfg, device="cpu", progress=False, max_steps_this_call=2)
    assert json.loads((tmp_path / "resumed" / "config.json").read_text())["training"]["steps_done"] == 2
    trainer.train(tiny_target, rows, tmp_path / "resumed", cfg, device="cpu", progress=False)
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert full["steps_done"] == 6 and full["data"]["held_out_sequences"] == 4
    assert set(full["held_out"]) == {"B4"} and 1.0 <= full["held_out"]["B4"]["tau"] <= 4.0
    with pytest.raises(core.TrainingDataError, match="another config"):
        trainer.train(tiny_target, rows, tmp_path / "full", dataclasses.replace(cfg, steps=7), device="cpu",
                      progress=False)


def test_bad_training_inputs_are_rejected(tmp_path, tiny_target):
    with pytest.raises(core.TrainingDataError, match="empty"):
        trainer.train_drafter(tmp_path, tmp_path / "out", [])
    with pytest.raises(core.TrainingDataError, match="prompt_lens"):
        trainer.train_drafter(tmp_path, tmp_path / "out", [[1, 2, 3]], prompt_lens=[1, 2])
    with pytest.raises(core.TrainingDataError, match="two tokens"):
        trainer.train_drafter(tiny_target, tmp_path / "out", [[1, 2, 3]], prompt_lens=[2])
    with pytest.raises(core.TrainingDataError, match="target_layer_ids"):
        core.build_draft_config({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                 "vocab_size": 16, "intermediate_size": 16}, target_layer_ids=[5])


def test_init_from_target_layers_copies_the_last_layers(tiny_target):
    from safetensors.torch import load_file

    config = core.build_draft_config(json.loads((Path(tiny_target) / "config.json").read_text()),
                                     num_layers=2, block_size=4, target_layer_ids=[0, 2])
    model = core.new_draft_model(config)
    core.init_from_target_layers(model, tiny_target, [0, 2])
    target = load_file(str(Path(tiny_target) / "model.safetensors"))
    for i, src in enumerate((2, 3)):  # 4 target layers: the drafter's 2 layers <- layers 2 and 3
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight"):
            assert torch.equal(model.layers[i].get_parameter(name), target[f"model.layers.{src}.{name}"])
        assert torch.equal(model.layers[i].self_attn.q_norm.weight, torch.ones(16))
    hidden = 64
    features = torch.randn(3, 2 * hidden)
    assert torch.equal(model.fc(features), features[:, hidden:])  # reads the deepest layer (id 2)
    assert torch.equal(model.hidden_norm.weight, target["model.layers.2.input_layernorm.weight"])


# -- growing the set with our engine ---------------------------------------------------------------
@pytest.mark.slow
def test_regenerate_appends_resumes_and_verifies(tmp_path, monkeypatch):
    from sgl_dflash.tools.tiny_pair import train_tokenizer
    from sgl_dflash.tools.train import regenerate
    from sgl_dflash.tools.train.__main__ import main as train_cli

    target = tmp_path / "target"
    tok = train_tokenizer([f"add {i} and {i + 1} gives {2 * i + 1}" for i in range(100)], 200, target)
    make_tiny_target(target, "llama", vocab_size=len(tok), hidden_size=32, num_hidden_layers=3,
                     num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                     eos_token_id=tok.eos_token_id)
    tok.save_pretrained(target)
    prompts = [{"id": f"p{i}", "prompt": f"add {i} and {i + 2}", "source": "test"} for i in range(10)]
    out = tmp_path / "set"
    regenerate.regenerate(target, out, prompts[:6], max_new_tokens=10, batch_size=4, shard_size=4)
    rs = regenerate.regenerate(target, out, prompts, max_new_tokens=10, batch_size=4, shard_size=4)
    assert sorted(r.id for r in rs) == sorted(p["id"] for p in prompts)  # nothing twice
    assert [s["responses"] for s in rs.manifest["shards"]] == [4, 2, 4]
    assert all(r.finish in ("stop", "length") and 1 <= len(r.output_ids) <= 10 for r in rs)
    assert rs.rows[0].prompt_ids.tolist() == regenerate.chat_prompt_ids(tok, prompts[0]["prompt"])
    # Interrupted (Ctrl-C) after two answers: those two are kept, the rerun does the rest.
    from sgl_dflash.entrypoints.engine import Engine

    streamed = Engine.generate_as_completed

    def interrupted(self, *args, **kwargs):
        stream = streamed(self, *args, **kwargs)
        yield next(stream)
        yield next(stream)
        stream.close()
        raise KeyboardInterrupt

    more = [{"id": f"q{i}", "prompt": f"add {i} and {i + 3}", "source": "test"} for i in range(5)]
    monkeypatch.setattr(Engine, "generate_as_completed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        regenerate.regenerate(target, out, more, max_new_tokens=10, batch_size=4, shard_size=4)
    assert ResponseSet.load(out).manifest["shards"][-1]["responses"] == 2
    monkeypatch.setattr(Engine, "generate_as_completed", streamed)
    rs = regenerate.regenerate(target, out, more, max_new_tokens=10, batch_size=4, shard_size=4)
    assert [s["responses"] for s in rs.manifest["shards"]] == [4, 2, 4, 2, 3]
    assert sorted(r.id for r in rs) == sorted(p["id"] for p in prompts + more)
    check = regenerate.verify(target, out, num=5, tokens=10)
    assert check["checked"] == 5 and check["identical"] == 5
    # A stored response the engine would not produce is caught.
    rows = [{"id": "bad", "source": "test", "prompt_ids": rs.rows[0].prompt_ids.tolist(),
             "output_ids": [(t + 1) % len(tok) for t in rs.rows[0].output_ids.tolist()], "finish": "length"}]
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    bad_set = tmp_path / "bad_set"
    train_cli(["import", str(jsonl), "--sampling", "greedy", "--target", str(target), "--set", str(bad_set)])
    assert regenerate.verify(target, bad_set, num=1, tokens=10)["mismatches"][0]["first_difference"] == 0
    # The trainer's CLI takes the row length (multi-turn rows are longer than the default 1024).
    train_cli(["train", "--target", str(target), "--set", str(out), "--out", str(tmp_path / "d"), "--holdout", "2",
               "--num-layers", "1", "--max-seq-len", "1000", "--tokens-per-batch", "64", "--max-steps-this-call", "1",
               "--device", "cpu"])
    assert torch.load(tmp_path / "d" / "train_state.pt", weights_only=False)["config"]["max_seq_len"] == 1000


def test_shipped_smollm2_drafter_loads_and_records_its_recipe():
    import sgl_dflash
    from sgl_dflash.tools import model_import
    from torchax_proposer import load_draft_model

    asset = Path(sgl_dflash.__file__).parent / "assets" / "smollm2-135m-dflash"
    config = json.loads((asset / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dtype"] == "bfloat16"
    assert config["dflash_config"]["block_size"] == 8 and config["num_hidden_layers"] == 3
    assert config["target"]["name"] == "SmolLM2-135M-Instruct"
    assert config["training"]["data"]["response_tokens"] >= 2_000_000
    assert config["training"]["held_out"]["B8"]["tau"] > 2.5 and config["training"]["held_out"]["B8"]["sequences"] >= 64
    for stage in config["training"]["stages"]:
        assert {"recipe", "command", "steps_done", "train_seconds"} <= set(stage)
    assert (asset / "model.safetensors").stat().st_size < 50 * 2**20
    token_map = json.loads((asset / "token_map.json").read_text())
    assert token_map == sorted(set(token_map)) and 0 < len(token_map) < config["vocab_size"]
    assert config["token_map"]["ids"] == len(token_map)  # its provenance and held-out tau by map size
    converted = model_import.default_model_dir() / "config.json"
    target = json.loads(converted.read_text()) if converted.is_file() else config["target"]
    model = load_draft_model(asset, {k: target[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers")})
    assert model.block_size == 8 and model.target_layer_ids == config["dflash_config"]["target_layer_ids"]


@pytest.mark.slow
def test_dflash2_drafters_train_and_draft_their_selector_path(tiny_target, tmp_path):
    """The same trainer trains DFlash 2 (convolutions + candidate selector): the loss adds the
    selector's CE, the checkpoint is z-lab's DFlash 2 format, and evaluation drafts the selector's
    greedy path (which the reference package walks the same way)."""
    from torchax_proposer import DFlash2DraftModel, load_draft_model

    _, seqs = greedy_sequences(tiny_target, 24, 6, 24, seed=5)
    dflash2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    log = trainer.train_drafter(tiny_target, tmp_path / "d2", seqs.tolist(), prompt_lens=[6] * len(seqs),
                                num_layers=1, block_size=4, steps=40, batch_size=8, num_anchors=8, lr=3e-3,
                                progress=False, dflash2=dflash2)
    losses = [r["loss"] for r in log["log"]]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    config = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 4
    target_config = json.loads((Path(tiny_target) / "config.json").read_text())
    model = load_draft_model(tmp_path / "d2", target_config)
    assert isinstance(model, DFlash2DraftModel)
    assert model.candidate_selector.successor_codebook.abs().sum() > 0  # the selector learned something
    rows = [Response(f"p{i}", "s", s[:6].numpy(), s[6:].numpy(), "length", "greedy")
            for i, s in enumerate(seqs[:4])]
    result = trainer.evaluate_checkpoint(tiny_target, rows, tmp_path / "d2", [4], holdout=4, trim_loops=False,
                                         device="cpu")
    assert 1.0 <= result["B4"]["tau"] <= 4.0 and result["B4"]["blocks"] > 0
    with pytest.raises(core.TrainingDataError, match="conv_group_size"):
        core.build_draft_config(target_config, dflash2={**dflash2, "conv_group_size": 7})


@pytest.mark.slow
def test_learning_curve_reads_run_records(trained, tmp_path):
    from sgl_dflash.tools.train.curve import run_row, write_curve

    out, _, _ = trained
    row = run_row(out)
    assert row["steps"] == 150 and len(row["loss_curve"]) >= 100 and row["held_out"] == {}
    assert row["follows"] is None
    extra = {"name": "older", "response_tokens": 1000, "held_out": {"B8": {"tau": 1.5}}}
    continued = {**row, "name": "continued", "follows": out.name, "steps": 40}
    json_path, png_path = write_curve([{**row, "held_out": {"B8": {"tau": 2.0}}}, extra, continued],
                                      tmp_path / "curve")
    written = json.loads(json_path.read_text())
    assert [r["name"] for r in written] == [out.name, "older", "continued"]
    assert [r["first_step"] for r in written] == [0, 0, 150]  # the continued run counts on from 150
    assert png_path.stat().st_size > 10_000
