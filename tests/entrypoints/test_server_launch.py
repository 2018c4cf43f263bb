"""`python -m sgl_dflash.launch_server`: SGLang's flag names, and invalid flags or combinations
refused at startup with a message naming the problem and a non-zero exit status."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from sgl_dflash import launch_server
from sgl_dflash.server_args import ServerArgs
from tests.server_harness import make_byte_target, start_in_process
from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = make_byte_target(tmp_path_factory.mktemp("launch_target"))
    draft = str(make_tiny_draft(tmp_path_factory.mktemp("launch_draft"), target, block_size=4))
    wide = make_tiny_target(tmp_path_factory.mktemp("launch_wide"), "qwen3", num_hidden_layers=2,
                            hidden_size=128, vocab_size=264)
    return {"target": target, "draft": draft, "wide": wide, "missing": str(tmp_path_factory.mktemp("empty"))}


def test_sglang_flag_names_parse():
    args = launch_server.prepare_server_args([
        "--model-path", "/m", "--tokenizer-path", "/t", "--skip-tokenizer-init",
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/d",
        "--speculative-num-draft-tokens", "8", "--host", "0.0.0.0", "--port", "31000", "--dtype", "bfloat16",
        "--page-size", "32", "--max-running-requests", "4", "--max-total-tokens", "2048",
        "--api-key", "k", "--log-level", "debug",
    ])
    assert (args.model_path, args.tokenizer_path, args.skip_tokenizer_init) == ("/m", "/t", True)
    assert (args.speculative_algorithm, args.speculative_draft_model_path) == ("DFLASH", "/d")
    assert args.speculative_num_draft_tokens == 8
    assert (args.host, args.port, args.dtype, args.page_size) == ("0.0.0.0", 31000, "bfloat16", 32)
    assert (args.max_running_requests, args.max_total_tokens) == (4, 2048)
    assert (args.api_key, args.log_level) == ("k", "debug")
    defaults = launch_server.prepare_server_args(["--model-path", "/m"])
    assert (defaults.host, defaults.port) == ("127.0.0.1", 30000)


@pytest.mark.parametrize("flags,needle", [
    (["--model-path", "{target}", "--speculative-algorithm", "DFLASH"], "--speculative-draft-model-path"),
    (["--model-path", "{wide}", "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
      "{draft}"], "hidden_size"),
    (["--model-path", "{target}", "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
      "{draft}", "--speculative-num-draft-tokens", "9"], "--speculative-num-draft-tokens"),
    (["--model-path", "{target}", "--speculative-draft-model-path", "{draft}"], "--speculative-algorithm"),
    (["--model-path", "{target}", "--speculative-algorithm", "MEDUSA"], "MEDUSA"),
    (["--model-path", "{missing}"], "config.json"),
    (["--model-path", "{target}", "--page-size", "0"], "--page-size"),
    (["--model-path", "{target}", "--tokenizer-path", "{missing}"], "tokenizer"),
])
def test_invalid_combinations_are_refused(dirs, flags, needle, capsys):
    argv = [f.format(**dirs) for f in flags]
    assert launch_server.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err


def test_cli_exit_status_and_message(dirs):
    result = subprocess.run(
        [sys.executable, "-m", "sgl_dflash.launch_server", "--model-path", dirs["target"],
         "--speculative-algorithm", "DFLASH"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "--speculative-draft-model-path" in result.stderr
    assert "Traceback" not in result.stderr


def test_skip_tokenizer_init_serves_token_ids_only(dirs):
    # Same limits as test_server's server: with the session's compilation cache, no new programs.
    args = ServerArgs(model_path=dirs["target"], skip_tokenizer_init=True, page_size=8,
                      max_total_tokens=256, max_running_requests=16)
    server = start_in_process(args)
    try:
        url = server.base_url
        r = requests.post(url + "/generate", json={"input_ids": [5, 6, 7],
                                                   "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert set(out) == {"output_ids", "meta_info"} and len(out["output_ids"]) == 4
        info = requests.get(url + "/get_model_info", timeout=10).json()
        assert info["tokenizer_path"] is None
        for path, body, needle in [
            ("/generate", {"text": "hi"}, "--skip-tokenizer-init"),
            ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "hi"}]},
             "--skip-tokenizer-init"),
            ("/v1/completions", {"model": "default", "prompt": "hi"}, "--skip-tokenizer-init"),
        ]:
            r = requests.post(url + path, json=body, timeout=30)
            body = r.json()
            message = body["error"]["message"] if path.startswith("/v1/") else body["message"]
            assert r.status_code == 400 and needle in message, r.text
        r = requests.post(url + "/v1/completions", json={"model": "default", "prompt": [5, 6, 7], "max_tokens": 4,
                                                         "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
