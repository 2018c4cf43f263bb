"""Our SGLang entry points, exercised through the real sglang 0.5.23 package (fast: no server):
the platform plugin (`sglang.srt.platforms`), what it resolves in SGLang's server arguments and
refuses, the general plugin's hooks, and the request features refused. The server itself runs in
test_sglang_server.py."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from sgl_dflash.errors import ServerArgsError
from sgl_dflash.integrations import sglang_platform, sglang_plugin
from sgl_dflash.integrations.sglang_args import unsupported_request
from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft


@pytest.fixture(scope="module")
def draft_dir(tiny_qwen3_dir, tmp_path_factory):
    return str(make_tiny_draft(tmp_path_factory.mktemp("draft"), tiny_qwen3_dir, block_size=4))


def test_entry_points_are_declared():
    (platform,) = [ep for ep in entry_points(group="sglang.srt.platforms") if ep.name == "dflash_jax"]
    assert platform.load() is sglang_platform.activate
    (plugin,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dflash_jax"]
    assert plugin.load() is sglang_plugin.register


def test_activate_only_where_sglang_has_no_device(monkeypatch):
    import torch

    ours = "sgl_dflash.integrations.sglang_platform.DFlashJaxPlatform"
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert sglang_platform.activate() == ours  # this CPU machine
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's own CPU engine asked for
    assert sglang_platform.activate() is None
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sglang_platform.activate() is None  # a GPU host: SGLang's CUDA platform
    monkeypatch.setenv("SGLANG_PLATFORM", "dflash_jax")  # ... unless selected explicitly
    assert sglang_platform.activate() == ours


def test_sglang_resolves_our_platform_and_worker():
    # A fresh process: SGLang's current_platform is a process-wide singleton.
    code = (
        "from sglang.srt.platforms import current_platform as p\n"
        "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "from sgl_dflash.integrations import sglang_plugin\n"
        "assert type(p).__name__ == 'DFlashJaxPlatform' and p.is_out_of_tree()\n"
        "assert p.supports_speculative_algorithm('DFLASH') and not p.supports_speculative_algorithm('EAGLE')\n"
        "w = SpeculativeAlgorithm.from_string('DFLASH').get_platform_worker_cls()\n"
        "assert w.__name__ == 'DFlashSpecWorker', w\n"
        "assert sglang_plugin.register() is True\n"
        "(kind, cls, _), = HookRegistry._hooks[sglang_plugin.TP_WORKER]\n"
        "assert kind.name == 'REPLACE' and cls.__name__ == 'JaxTpModelWorker'\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def resolve(model_path, **kwargs):
    """SGLang's ServerArgs after our platform's defaults, as its handle_platform_defaults runs them."""
    from sglang.srt.arg_groups.overrides import record_foreign_defaults, resolving_view
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model_path, device="cpu", **kwargs)
    record_foreign_defaults(args, "platform:cpu", sglang_platform.DFlashJaxPlatform().apply_server_args_defaults)
    return resolving_view(args)


def test_platform_defaults(tiny_qwen3_dir, draft_dir):
    view = resolve(tiny_qwen3_dir, speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir)
    assert view.speculative_num_draft_tokens == 4  # the drafter's block size, read by us
    assert (view.page_size, view.disable_overlap_schedule, view.disable_radix_cache) == (1, True, True)
    assert (view.grammar_backend, view.disable_cuda_graph) == ("none", True)
    plain = resolve(tiny_qwen3_dir)
    assert plain.page_size == 1 and plain.speculative_num_draft_tokens is None


def test_platform_refusals(tiny_qwen3_dir, draft_dir, tmp_path):
    with pytest.raises(ValueError, match="--page-size 16"):
        resolve(tiny_qwen3_dir, page_size=16)
    with pytest.raises(ValueError, match="--tp-size 2"):
        resolve(tiny_qwen3_dir, tp_size=2)
    with pytest.raises(ValueError, match="--speculative-algorithm 'EAGLE'"):
        resolve(tiny_qwen3_dir, speculative_algorithm="EAGLE", speculative_draft_model_path=draft_dir)
    with pytest.raises(ServerArgsError, match="--speculative-num-draft-tokens.*\\[2, 4\\]"):
        resolve(tiny_qwen3_dir, speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir,
                speculative_num_draft_tokens=9)
    wide = make_tiny_target(tmp_path / "wide", "qwen3", num_hidden_layers=2, hidden_size=128)
    with pytest.raises(ServerArgsError, match="hidden_size"):
        resolve(wide, speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir)


def fake_req(**params):
    defaults = dict(min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                    min_new_tokens=0, logit_bias=None)
    return SimpleNamespace(return_logprob=params.pop("return_logprob", False), return_hidden_states=False,
                           custom_logit_processor=None, sampling_params=SimpleNamespace(**{**defaults, **params}))


def test_unsupported_requests_are_named():
    assert unsupported_request(fake_req()) is None
    assert "logprobs" in unsupported_request(fake_req(return_logprob=True))
    message = unsupported_request(fake_req(repetition_penalty=1.2, min_p=0.1))
    assert "penalties" in message and "min_p" in message
    calls = []
    assert sglang_plugin.refuse_unsupported_requests(lambda *a: calls.append(a) or None, fake_req()) is None
    assert calls  # SGLang's own length check still runs


def test_register_is_a_no_op_without_sglang():
    code = (
        "import sys; sys.modules['sglang'] = None  # makes `import sglang` fail\n"
        "from sgl_dflash.integrations.sglang_plugin import register\n"
        "assert register() is False\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
