"""SamplingParams / ServerArgs validation: bad input gets a ValueError naming the field or flag."""

import argparse

import pytest

import jax_backend.runner
from jax_backend import TargetRunner
from jax_backend.model import LayerBranches
from sgl_dflash.errors import InvalidRequestError, SamplingParamsError
from sgl_dflash.sampling_params import SamplingParams
from sgl_dflash.errors import ServerArgsError
from sgl_dflash.server_args import LAYER_LOOPS, ServerArgs


def test_defaults_match_sglang():
    sp = SamplingParams()
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k) == (128, 1.0, 1.0, -1)
    assert sp.stop is None and sp.stop_token_ids is None and sp.ignore_eos is False
    sp.verify(vocab_size=16)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [1, 99]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_values_name_the_field(params, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams.from_dict(params).verify(vocab_size=16)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InvalidRequestError)


def test_unknown_key_is_refused():
    with pytest.raises(SamplingParamsError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_valid_values_pass():
    for params in (
        {"temperature": 0.0, "max_new_tokens": 0},
        {"top_p": 1.0, "top_k": 0},
        {"top_k": 5, "stop": ["a", "bc"], "stop_token_ids": [0, 15], "ignore_eos": True},
    ):
        SamplingParams.from_dict(params).verify(vocab_size=16)
    assert SamplingParams(stop="x").stop_strs == ["x"]


def test_cli_flags_use_sglang_spelling(tiny_qwen3_dir):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args([
        "--model-path", tiny_qwen3_dir, "--speculative-algorithm", "none", "--page-size", "8",
        "--max-total-tokens", "512", "--port", "31000", "--api-key", "k", "--skip-tokenizer-init",
    ])
    sa = ServerArgs.from_cli_args(args)
    assert (sa.model_path, sa.page_size, sa.max_total_tokens, sa.port, sa.api_key) == (
        tiny_qwen3_dir, 8, 512, 31000, "k")
    sa.check()
    assert sa.speculative_algorithm is None
    assert sa.context_length == 1024  # the target's max_position_embeddings
    alias = parser.parse_args(["--model-path", "m", "--speculative-dflash-block-size", "4"])
    assert alias.speculative_num_draft_tokens == 4


@pytest.mark.parametrize("flags, loop, layout, switch_layout", [
    ([], "auto", dict, LayerBranches),  # on a CPU, decode steps may run the switch (LayoutTuner)
    (["--layer-loop", "scan"], "scan", dict, dict),
    (["--layer-loop", "switch"], "switch", LayerBranches, LayerBranches),
    (["--layer-loop", "unrolled"], "unrolled", list, list),
    (["--unroll-layers"], "unrolled", list, list),  # the older spelling
])
def test_layer_loop_flag_reaches_the_target_runner(tiny_qwen3_dir, flags, loop, layout, switch_layout):
    from sgl_dflash.model_executor.target_worker import TargetWorker

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", tiny_qwen3_dir, "--max-total-tokens", "256", "--skip-tokenizer-init"]
    sa = ServerArgs.from_cli_args(parser.parse_args(argv + flags)).check()
    assert sa.layer_loop == loop
    runner = TargetWorker(sa).runner
    assert runner.layer_loop == loop and type(runner._step_params["layers"]) is layout
    assert type(runner._switch_params["layers"]) is switch_layout
    assert (runner._tuner is not None) == (loop == "auto")


def test_layer_loop_refuses_unknown_and_contradicting_values(tiny_qwen3_dir):
    assert LAYER_LOOPS == jax_backend.runner.LAYER_LOOPS
    with pytest.raises(ServerArgsError, match="--layer-loop must be one of"):
        ServerArgs(model_path=tiny_qwen3_dir, layer_loop="while").check()
    with pytest.raises(ServerArgsError, match="--unroll-layers contradicts --layer-loop switch"):
        ServerArgs(model_path=tiny_qwen3_dir, layer_loop="switch", unroll_layers=True).check()
    with pytest.raises(ServerArgsError, match="--unroll-layers contradicts --layer-loop scan"):
        ServerArgs(model_path=tiny_qwen3_dir, layer_loop="scan", unroll_layers=True).check()
    with pytest.raises(ValueError, match="layer_loop must be one of"):
        TargetRunner(tiny_qwen3_dir, layer_loop="unroll")


def test_server_args_refuse_bad_combinations(tiny_qwen3_dir, tmp_path):
    with pytest.raises(ServerArgsError, match="--model-path"):
        ServerArgs(model_path=str(tmp_path)).check()
    with pytest.raises(ServerArgsError, match="--page-size"):
        ServerArgs(model_path=tiny_qwen3_dir, page_size=0).check()
    with pytest.raises(ServerArgsError, match="--dtype"):
        ServerArgs(model_path=tiny_qwen3_dir, dtype="fp8").check()
    with pytest.raises(ServerArgsError, match="max_position_embeddings"):
        ServerArgs(model_path=tiny_qwen3_dir, context_length=4096).check()
    with pytest.raises(ValueError, match="registered: .*DFLASH"):
        ServerArgs(model_path=tiny_qwen3_dir, speculative_algorithm="EAGLE9").check()
    with pytest.raises(ServerArgsError, match="--speculative-algorithm is NONE"):
        ServerArgs(model_path=tiny_qwen3_dir, speculative_draft_model_path=str(tmp_path)).check()
    with pytest.raises(ServerArgsError, match="--speculative-draft-model-path"):
        ServerArgs(model_path=tiny_qwen3_dir, speculative_algorithm="DFLASH").check()
