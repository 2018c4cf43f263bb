"""DFlash drafter training: anchors, the block attention mask, the loss, and a tiny end-to-end run
whose trained drafter is measured with the z-lab reference `dflash_generate` (real spec decoding)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sgl_dflash.train import core
from tests.tiny_checkpoints import load_hf_model, make_tiny_target

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

BLOCK = 8


def test_valid_anchor_positions_need_two_supervised_tokens():
    mask = np.array([0, 1, 1, 1, 0, 1, 0, 1, 1], dtype=bool)
    assert core.valid_anchor_positions(mask).tolist() == [1, 2, 7]
    rng = np.random.default_rng(0)
    assert core.sample_anchors(mask, 10, rng).tolist() == [1, 2, 7]
    picked = core.sample_anchors(np.ones(100, dtype=bool), 5, rng)
    assert len(set(picked.tolist())) == 5 and (np.diff(picked) > 0).all()


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


def test_make_batch_labels_are_the_tokens_after_each_anchor():
    tokens = [np.arange(10, 20), np.arange(30, 36)]
    masks = [np.ones(10, dtype=bool), np.array([0, 0, 1, 1, 1, 1], dtype=bool)]
    feats = [torch.zeros(10, 4), torch.zeros(6, 4)]
    batch = core.make_batch(tokens, masks, feats, block_size=4, num_anchors=3,
                            rng=np.random.default_rng(1))
    for row in range(2):
        for j, a in enumerate(batch.anchors[row].tolist()):
            for k in range(3):
                if batch.label_mask[row, j, k]:
                    assert batch.labels[row, j, k] == batch.token_ids[row, a + 1 + k]
                    assert masks[row][a + 1 + k]
    # Second sequence: anchors only at 2, 3, 4; labels past the end are masked.
    assert sorted(batch.anchors[1].tolist()) == [2, 3, 4]
    assert batch.label_mask[1].sum(-1).tolist() == [3, 2, 1]


def test_sampled_softmax_keeps_every_label_and_equals_full_ce_when_it_covers_the_vocab():
    vocab = core.TrainVocab(torch.tensor([7, 3, 3, 11]), vocab_size=16, num_negatives=4)
    assert vocab.ids.tolist() == [3, 7, 11] and vocab.index[[3, 7, 11, 5]].tolist() == [0, 1, 2, -1]
    head = torch.randn(16, 8)
    rows = vocab.rows(head, torch.Generator().manual_seed(0))
    assert rows.shape == (3 + 4, 8) and torch.equal(rows[:3], head[[3, 7, 11]])
    others = {tuple(r.tolist()) for r in rows[3:]}
    assert not others & {tuple(head[i].tolist()) for i in (3, 7, 11)}  # negatives are other ids

    # With every id covered (num_negatives >= the rest), the sampled loss is the full loss.
    from torchax_proposer import DFlashConfig

    config = core.build_draft_config({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                      "intermediate_size": 16, "vocab_size": 16}, block_size=4,
                                     target_layer_ids=[0])
    model = core.new_draft_model(config)
    assert DFlashConfig.from_dict(config).block_size == 4
    tokens = [np.array([1, 3, 7, 11, 3, 7, 11, 3])]
    batch = core.make_batch(tokens, [np.ones(8, dtype=bool)], [torch.randn(8, 8)], block_size=4,
                            num_anchors=3, rng=np.random.default_rng(0))
    embed = torch.randn(16, 8)
    weights = core.loss_weights(4)
    full, _ = core.dflash_loss(model, embed, head, batch, block_size=4, weights=weights)
    covered = core.TrainVocab(torch.tensor([3, 7, 11]), vocab_size=16, num_negatives=100)
    sampled, _ = core.dflash_loss(model, embed, head, batch, block_size=4, weights=weights, vocab=covered,
                                  generator=torch.Generator().manual_seed(0))
    assert torch.allclose(full, sampled, atol=1e-5)
    # Labels outside the used ids are not supervised (no index error, finite loss).
    partial = core.TrainVocab(torch.tensor([3, 7]), vocab_size=16, num_negatives=2)
    loss, _ = core.dflash_loss(model, embed, head, batch, block_size=4, weights=weights, vocab=partial)
    assert torch.isfinite(loss)


def test_lr_schedule_warms_up_then_decays_to_zero():
    lrs = [core.lr_at(s, 100, 1.0) for s in range(100)]
    assert lrs[0] == pytest.approx(0.25) and lrs[3] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])) and lrs[-1] < 0.01


def test_bad_training_inputs_are_rejected(tmp_path):
    with pytest.raises(core.TrainingDataError, match="empty"):
        core.train_drafter(tmp_path, tmp_path / "out", [])
    with pytest.raises(core.TrainingDataError, match="loss_mask"):
        core.train_drafter(tmp_path, tmp_path / "out", [[1, 2, 3]], loss_mask=[[True]])
    with pytest.raises(core.TrainingDataError, match="target_layer_ids"):
        core.build_draft_config({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                 "vocab_size": 16, "intermediate_size": 16}, target_layer_ids=[5])


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
    prompts, seqs = greedy_sequences(tiny_target, 48, 8, 40, seed=0)
    mask = torch.ones_like(seqs, dtype=torch.bool)
    mask[:, :8] = False  # supervise the generated part only
    out = tmp_path_factory.mktemp("draft")
    result = core.train_drafter(tiny_target, out, seqs.tolist(), loss_mask=mask.tolist(), num_layers=1,
                                block_size=BLOCK, steps=150, batch_size=8, num_anchors=16,
                                lr=3e-3, seed=0, progress=False)
    untrained = tmp_path_factory.mktemp("untrained")
    core.train_drafter(tiny_target, untrained, seqs.tolist(), loss_mask=mask.tolist(), num_layers=1,
                       block_size=BLOCK, steps=0, seed=0, progress=False)
    return result, untrained


def test_training_loss_decreases(trained):
    result, _ = trained
    first, last = np.mean(result.losses[:10]), np.mean(result.losses[-10:])
    assert last < 0.6 * first, (first, last)


def test_checkpoint_is_zlab_format(trained, tiny_target):
    result, _ = trained
    config = json.loads((result.out_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["block_size"] == BLOCK
    assert config["dflash_config"]["target_layer_ids"] == [2]
    assert config["target"]["path"] == str(tiny_target)
    assert config["training"]["lr"] == 3e-3
    from safetensors import safe_open

    with safe_open(result.out_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith(("model.", "embed", "lm_head")) for n in names)


def test_trained_drafter_is_accepted_more_than_random(trained, tiny_target):
    result, untrained = trained
    held_out = torch.randint(3, 120, (4, 8), generator=torch.Generator().manual_seed(123))
    tau_trained = reference_tau(result.out_dir, tiny_target, held_out, 32)
    tau_random = reference_tau(untrained, tiny_target, held_out, 32)
    print(f"tau trained {tau_trained:.2f} random {tau_random:.2f}")
    assert tau_trained > tau_random + 0.5, (tau_trained, tau_random)


def test_pipeline_regenerates_caches_features_and_resumes_exactly(tmp_path):
    """Fused regenerate+features stage (resumable per batch), then training interrupted and resumed
    gives bit-identical weights to an uninterrupted run."""
    from safetensors.torch import load_file

    from sgl_dflash.tools.tiny_pair import train_tokenizer
    from sgl_dflash.train import pipeline

    target = tmp_path / "target"
    tok = train_tokenizer([f"add {i} and {i + 1} gives {2 * i + 1}" for i in range(100)], 200, target)
    make_tiny_target(target, "llama", vocab_size=len(tok), hidden_size=32, num_hidden_layers=3,
                     num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    tok.save_pretrained(target)
    prompts = [{"id": f"p{i}", "prompt": f"add {i} and {i + 2}", "source": "test"} for i in range(10)]
    work = tmp_path / "work"
    pipeline.regenerate_with_features(target, work, prompts[:6], [0, 1], max_new_tokens=10, batch_size=4)
    pipeline.regenerate_with_features(target, work, prompts, [0, 1], max_new_tokens=10, batch_size=4)
    rows = pipeline.read_responses(work / "responses.jsonl")
    assert sorted(r["id"] for r in rows) == sorted(p["id"] for p in prompts)  # nothing twice
    store = pipeline.FeatureStore(work / "features")
    assert len(store) == 10
    # Cached features == the target's layer outputs recomputed on the full sequence.
    model = core.load_frozen_target(target)
    tokens, mask, feats = store.items[-1]
    expected = core.target_features(model, torch.as_tensor(tokens)[None], [0, 1])[0]
    assert mask.sum() == len(tokens) - len(rows[-1]["prompt_ids"]) and mask[-1]
    torch.testing.assert_close(feats[:-1].float(), expected[:-1], atol=2e-3, rtol=2e-3)

    # Our Engine writes the same training data in its one pass (tokens equal, features within fp16).
    engine_work = tmp_path / "engine_work"
    pipeline.regenerate(target, engine_work, prompts[:4], [0, 1], max_new_tokens=10, batch_size=4)
    pipeline.regenerate(target, engine_work, prompts, [0, 1], max_new_tokens=10, batch_size=4)  # resumes
    assert sorted(r["id"] for r in pipeline.read_responses(engine_work / "responses.jsonl")) == sorted(
        p["id"] for p in prompts)
    by_tokens = {tuple(t.tolist()): (m, f) for t, m, f in store.items}

    def assert_same_data(feat_dir):
        other = pipeline.FeatureStore(feat_dir)
        assert len(other) == 10
        for t, m, f in other.items:
            ref_mask, ref_feats = by_tokens[tuple(t.tolist())]
            assert np.array_equal(m, ref_mask)
            torch.testing.assert_close(f.float(), ref_feats.float(), atol=2e-3, rtol=2e-3)

    assert_same_data(engine_work / "features")
    # The separate features stage (responses generated without features) writes the same shards.
    late = tmp_path / "late_features"
    late.mkdir()
    (late / "responses.jsonl").write_text((engine_work / "responses.jsonl").read_text())
    pipeline.compute_features(target, late, [0, 1], shard_size=5)
    assert_same_data(late / "features")

    args = pipeline.TrainArgs(num_layers=1, block_size=4, steps=6, batch_size=2, num_anchors=4,
                              save_every=2, holdout=2, lr=1e-3)
    pipeline.train(target, work, tmp_path / "full", args)
    full = load_file(tmp_path / "full" / "model.safetensors")
    pipeline.train(target, work, tmp_path / "resumed", args, stop_after=3)
    pipeline.train(target, work, tmp_path / "resumed", args)
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    config = json.loads((tmp_path / "resumed" / "config.json").read_text())
    assert config["training"]["steps_done"] == 6 and config["dtype"] == "bfloat16"
    assert config["target"]["num_hidden_layers"] == 3


def test_init_from_target_layers_copies_the_last_layers(tiny_target):
    from safetensors.torch import load_file

    from sgl_dflash.train import pipeline

    config = core.build_draft_config(json.loads((Path(tiny_target) / "config.json").read_text()),
                                     num_layers=2, block_size=4, target_layer_ids=[0, 2])
    model = core.new_draft_model(config)
    pipeline.init_from_target_layers(model, tiny_target, [0, 2])
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


def test_shipped_smollm2_drafter_loads_and_records_its_recipe():
    import sgl_dflash
    from sgl_dflash.tools import model_import
    from torchax_proposer import load_draft_model

    asset = Path(sgl_dflash.__file__).parent / "assets" / "smollm2-135m-dflash"
    config = json.loads((asset / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dtype"] == "bfloat16"
    assert config["dflash_config"]["block_size"] == 16
    assert config["target"]["name"] == "SmolLM2-135M-Instruct"
    for key in ("lr", "steps_done", "loss_gamma", "data", "held_out", "num_sequences"):
        assert key in config["training"], key
    assert (asset / "model.safetensors").stat().st_size < 50 * 2**20
    converted = model_import.default_model_dir() / "config.json"
    target = json.loads(converted.read_text()) if converted.is_file() else config["target"]
    model = load_draft_model(asset, {k: target[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers")})
    assert model.block_size == 16 and model.target_layer_ids == config["dflash_config"]["target_layer_ids"]
