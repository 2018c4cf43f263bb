"""Every way a drafter checkpoint can be unusable raises DraftCheckpointError naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_draft import DFLASH2_TINY, make_tiny_draft, single_torch_thread  # noqa: F401
from torchax_proposer import DFlash2DraftModel, DraftCheckpointError, load_draft_model

TARGET_MODEL = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    vocab_size=256, num_hidden_layers=4,
)
TARGET = dict(hidden_size=64, vocab_size=256, num_hidden_layers=4)


def edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


# (make_tiny_draft options, edit of the written files, target config, expected message)
CASES = {
    "hidden_size_mismatch": (dict(hidden_size=48), None, TARGET, "drafter hidden_size=48 != target hidden_size=64"),
    "vocab_mismatch": (dict(vocab_size=300), None, TARGET, "drafter vocab_size=300 != target vocab_size=256"),
    "layer_ids_out_of_range": (
        dict(target_layer_ids=[0, 4]), None, TARGET, r"target_layer_ids \[0, 4\] has \[4\] out of range of the target's 4 layers"
    ),
    "default_layer_ids_out_of_range": (
        dict(num_layers=2, target_layer_ids=None, num_target_layers=None), None, dict(TARGET, num_hidden_layers=2),
        r"has \[-1\] out of range",
    ),
    "num_target_layers_mismatch": (
        dict(num_target_layers=36), None, TARGET, "num_target_layers=36 != target num_hidden_layers=4"
    ),
    "mask_token_outside_vocab": (
        dict(mask_token_id=256), None, TARGET, r"mask_token_id=256 is outside the target vocabulary \[0, 256\)"
    ),
    "mask_token_missing": (dict(mask_token_id=None), None, TARGET, "no 'mask_token_id'"),
    "mask_token_not_int": (dict(mask_token_id="x"), None, TARGET, "'mask_token_id' must be an integer"),
    "layer_ids_not_list": (dict(target_layer_ids=[]), None, TARGET, "'target_layer_ids' must be a non-empty list"),
    "heads_not_multiple": (dict(num_key_value_heads=3), None, TARGET, "not a multiple of num_key_value_heads=3"),
    "dynamic_rope": (
        dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), None, TARGET, "rope_type='dynamic' is not supported"
    ),
    "unknown_architecture": (
        dict(architectures=["LlamaForCausalLM"]), None, TARGET,
        "only 'DFlashDraftModel' and 'DFlash2DraftModel' are supported",
    ),
    # DFlash 2: its config keys, then its tensors.
    "dflash2_without_its_keys": (
        dict(architectures=["DFlash2DraftModel"]), None, TARGET,
        r"DFlash2DraftModel config is missing \['conv_kernel_size', 'conv_group_size', 'selector_rank', 'selector_top_k'\]",
    ),
    "dflash2_missing_selector_keys": (
        dict(dflash2=DFLASH2_TINY),
        ("config", lambda c: (c["dflash_config"].pop("selector_rank"), c["dflash_config"].pop("selector_top_k"))),
        TARGET, r"missing \['selector_rank', 'selector_top_k'\]",
    ),
    "dflash2_group_not_dividing_hidden": (
        dict(dflash2=dict(DFLASH2_TINY, conv_group_size=24)), None, TARGET,
        "conv_group_size=24 does not divide hidden_size=64",
    ),
    "dflash2_top_k_above_vocab": (
        dict(dflash2=dict(DFLASH2_TINY, selector_top_k=257)), None, TARGET, "selector_top_k=257 exceeds vocab_size=256"
    ),
    "dflash2_kernel_longer_than_block": (
        dict(dflash2=dict(DFLASH2_TINY, conv_kernel_size=9)), None, TARGET, "conv_kernel_size=9 exceeds block_size=8"
    ),
    "dflash2_rank_not_int": (
        dict(dflash2=DFLASH2_TINY), ("config", lambda c: c["dflash_config"].update(selector_rank="8")), TARGET,
        "'selector_rank' must be an integer",
    ),
    "dflash2_rank_zero": (
        dict(dflash2=DFLASH2_TINY), ("config", lambda c: c["dflash_config"].update(selector_rank=0)), TARGET,
        "'selector_rank' must be positive",
    ),
    "dflash2_missing_codebook": (
        dict(dflash2=DFLASH2_TINY), ("tensors", lambda t: t.pop("candidate_selector.successor_codebook")), TARGET,
        r"missing tensors: \['candidate_selector.successor_codebook'\]",
    ),
    # transformers' nn.Embedding spelling is not z-lab's format (the reference maps the bare name).
    "dflash2_codebook_with_weight_suffix": (
        dict(dflash2=DFLASH2_TINY),
        ("tensors", lambda t: t.update({"candidate_selector.predecessor_codebook.weight":
                                        t.pop("candidate_selector.predecessor_codebook")})),
        TARGET, r"missing tensors: \['candidate_selector.predecessor_codebook'\]",
    ),
    "dflash2_wrong_conv_shape": (
        dict(dflash2=DFLASH2_TINY),
        ("tensors", lambda t: t.update({"layers.0.mlp_conv.base_kernel": torch.zeros(2, 3, 64)})), TARGET,
        r"layers.0.mlp_conv.base_kernel: \(2, 3, 64\) \(expected \(2, 2, 64\)\)",
    ),
    "dflash2_tensors_in_dflash1_checkpoint": (
        dict(dflash2=DFLASH2_TINY), ("config", lambda c: c.update(architectures=["DFlashDraftModel"])), TARGET,
        r"unexpected tensors: \['candidate_selector.hidden_projection.weight'",
    ),
    "missing_tensor": (
        {}, ("tensors", lambda t: t.pop("layers.0.mlp.up_proj.weight")), TARGET,
        r"missing tensors: \['layers.0.mlp.up_proj.weight'\]",
    ),
    "unexpected_tensor": (
        {}, ("tensors", lambda t: t.update({"lm_head.weight": torch.zeros(256, 64)})), TARGET,
        r"unexpected tensors: \['lm_head.weight'\]",
    ),
    "wrong_shape": (
        {}, ("tensors", lambda t: t.update({"fc.weight": torch.zeros(64, 64)})), TARGET,
        r"wrong shape: \['fc.weight: \(64, 64\) \(expected \(64, 128\)\)'\]",
    ),
    "integer_tensor": (
        {}, ("tensors", lambda t: t.update({"norm.weight": torch.ones(64, dtype=torch.int32)})), TARGET,
        "norm.weight has non-float dtype",
    ),
    "missing_config_key": ({}, ("config", lambda c: c.pop("hidden_size")), TARGET, "missing the key 'hidden_size'"),
    "dflash_config_not_object": (
        {}, ("config", lambda c: c.update(dflash_config=[1])), TARGET, "'dflash_config' must be a JSON object"
    ),
    "config_not_object": ({}, ("raw_config", "[1, 2]"), TARGET, "must be a JSON object, got list"),
    "malformed_json": ({}, ("raw_config", "{not json"), TARGET, "config.json is not valid JSON"),
    "missing_config": ({}, ("delete", "config.json"), TARGET, "no config.json in drafter directory"),
    "missing_weights": ({}, ("delete", "model.safetensors"), TARGET, r"no \*.safetensors file"),
    "corrupt_weights": ({}, ("raw_weights", b"\x00garbage"), TARGET, "cannot read .*model.safetensors"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_is_named(tmp_path, case):
    options, edit, target, message = CASES[case]
    options = {"num_layers": 1, "target_layer_ids": [1, 2], **options}
    path = make_tiny_draft(tmp_path / case, TARGET_MODEL, **options)
    if edit is not None:
        kind, what = edit
        if kind == "tensors":
            edit_tensors(path, what)
        elif kind == "config":
            edit_config(path, what)
        elif kind == "raw_config":
            (path / "config.json").write_text(what)
        elif kind == "raw_weights":
            (path / "model.safetensors").write_bytes(what)
        else:
            (path / what).unlink()
    with pytest.raises(DraftCheckpointError, match=message):
        load_draft_model(path, target)


def test_good_checkpoint_loads(tmp_path):
    model = load_draft_model(make_tiny_draft(tmp_path, TARGET_MODEL, target_layer_ids=[1, 2]), TARGET)
    assert model.target_layer_ids == [1, 2] and model.mask_token_id == 255 and model.block_size == 8
    assert not any(p.requires_grad for p in model.parameters())


def test_good_dflash2_checkpoint_loads(tmp_path):
    path = make_tiny_draft(tmp_path, TARGET_MODEL, num_layers=2, target_layer_ids=[1, 2], dflash2=DFLASH2_TINY)
    model = load_draft_model(path, TARGET)
    assert isinstance(model, DFlash2DraftModel) and model.config.is_dflash2 and model.top_k == 4
    assert (model.config.conv_kernel_size, model.config.conv_group_size, model.config.selector_rank) == (2, 16, 8)
    # Keys at the top level are read too (dflash_config first), as the reference does.
    config = json.loads((path / "config.json").read_text())
    config["selector_top_k"] = config["dflash_config"].pop("selector_top_k") + 2
    (path / "config.json").write_text(json.dumps(config))
    assert load_draft_model(path, TARGET).top_k == 6


def test_error_is_a_value_error_and_target_config_is_checked(tmp_path):
    assert issubclass(DraftCheckpointError, ValueError)
    path = make_tiny_draft(tmp_path, TARGET_MODEL, target_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="target_config is missing 'vocab_size'"):
        load_draft_model(path, {"hidden_size": 64, "num_hidden_layers": 4})
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_draft_model(path, TARGET, dtype="float64")
