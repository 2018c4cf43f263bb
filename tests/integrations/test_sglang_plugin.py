"""The `sglang.srt.plugins` entry point, exercised through the real sglang 0.5.23 package:
its plugin loader finds and runs `register()`, its registry resolves DFLASH_JAX, its argument
resolution machinery runs our validator, and its `create_worker` returns our worker class."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from sgl_dflash.errors import ServerArgsError
from sgl_dflash.integrations import sglang_plugin
from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft

@pytest.fixture(scope="module")
def draft_dir(tiny_qwen3_dir, tmp_path_factory):
    return str(make_tiny_draft(tmp_path_factory.mktemp("draft"), tiny_qwen3_dir, block_size=4))


@pytest.fixture(scope="module")
def registered_algo(monkeypatch_module):
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    # SGLang's own discovery, restricted (its allow-list env) to this plugin.
    monkeypatch_module.setenv("SGLANG_PLUGINS", "dflash_jax")
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert set(plugins) == {"dflash_jax"}
    func, dist = plugins["dflash_jax"]
    assert func is sglang_plugin.register and dist == "sgl-dflash"
    assert func() is True
    return SpeculativeAlgorithm.from_string("dflash_jax")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def sglang_server_args(model_path, **kwargs):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=model_path, speculative_algorithm="DFLASH_JAX", device="cpu", **kwargs)


def run_validator(algo, server_args):
    """What SGLang's handle_speculative_decoding does with a plugin's validator."""
    from sglang.srt.arg_groups.overrides import record_foreign_defaults, resolving_view

    record_foreign_defaults(server_args, "handle_speculative_decoding.custom_validate",
                            algo.validate_server_args)
    return resolving_view(server_args)


def test_entry_point_is_declared_and_resolves():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dflash_jax"]
    assert ep.value == "sgl_dflash.sglang_plugin:register"
    assert ep.load() is sglang_plugin.register


def test_registration_through_sglang_registry(registered_algo):
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    assert isinstance(registered_algo, CustomSpecAlgo)
    assert registered_algo.name == "DFLASH_JAX"
    assert registered_algo.factory is sglang_plugin.worker_factory
    assert registered_algo.supports_overlap is False
    assert not registered_algo.is_dflash()  # SGLang's builtin DFLASH code paths stay out of it
    assert sglang_plugin.register() is True  # idempotent: already registered by us


def test_validator_fills_defaults_in_sglang_server_args(registered_algo, tiny_qwen3_dir, draft_dir):
    view = run_validator(registered_algo, sglang_server_args(tiny_qwen3_dir, speculative_draft_model_path=draft_dir))
    assert view.speculative_num_draft_tokens == 4  # the drafter's block_size
    assert view.disable_overlap_schedule is True


def test_validator_refuses_bad_arguments(registered_algo, tiny_qwen3_dir, draft_dir, tmp_path):
    with pytest.raises(ServerArgsError, match="--speculative-draft-model-path"):
        run_validator(registered_algo, sglang_server_args(tiny_qwen3_dir))
    with pytest.raises(ServerArgsError, match="--speculative-num-draft-tokens.*\\[2, 4\\]"):
        run_validator(registered_algo, sglang_server_args(
            tiny_qwen3_dir, speculative_draft_model_path=draft_dir, speculative_num_draft_tokens=9))
    wide_target = make_tiny_target(tmp_path / "wide", "qwen3", num_hidden_layers=2, hidden_size=128)
    with pytest.raises(ServerArgsError, match="hidden_size"):
        run_validator(registered_algo, sglang_server_args(wide_target, speculative_draft_model_path=draft_dir))
    with pytest.raises(ServerArgsError, match="no config.json"):
        run_validator(registered_algo, sglang_server_args(
            tiny_qwen3_dir, speculative_draft_model_path=str(tmp_path / "missing")))


def test_sglang_create_worker_returns_our_worker_which_points_to_our_server(
    registered_algo, tiny_qwen3_dir, draft_dir
):
    server_args = sglang_server_args(tiny_qwen3_dir, speculative_draft_model_path=draft_dir)
    run_validator(registered_algo, server_args)
    worker_cls = registered_algo.create_worker(server_args)
    assert worker_cls is sglang_plugin.DFlashJaxWorker
    with pytest.raises(ServerArgsError, match="python -m sgl_dflash.launch_server"):
        worker_cls(server_args=server_args, gpu_id=0, nccl_port=0, target_worker=None)


def test_register_is_a_no_op_without_sglang():
    code = (
        "import sys; sys.modules['sglang'] = None  # makes `import sglang` fail\n"
        "from sgl_dflash.sglang_plugin import register\n"
        "assert register() is False\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
