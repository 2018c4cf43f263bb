"""Helpers for the server tests: a tiny byte-level tokenizer with a chat template, and servers
started for real (in-process uvicorn on a free loopback port, or `python -m
sgl_dflash.launch_server` in a subprocess)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests
import uvicorn

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# 256 byte tokens + the special tokens, padded with reserved tokens to this size.
TOKENIZER_VOCAB_SIZE = 264


def save_byte_tokenizer(model_dir: str | os.PathLike) -> None:
    """A byte-level tokenizer (one token per UTF-8 byte, no merges) with a ChatML template, saved
    in `model_dir` with the HF files AutoTokenizer reads. Vocab: bytes 0-255 (ids 0-255 in
    ByteLevel's alphabet order), then SPECIAL_TOKENS, then reserved ones up to
    TOKENIZER_VOCAB_SIZE; <|im_end|> is the EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: byte for byte, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(TOKENIZER_VOCAB_SIZE - 256 - len(SPECIAL_TOKENS))]
    tok.add_special_tokens(SPECIAL_TOKENS + reserved)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
    assert len(fast) == TOKENIZER_VOCAB_SIZE
    fast.save_pretrained(model_dir)
    # The target's EOS is the tokenizer's (the scheduler reads generation_config.json too).
    config_path = Path(model_dir) / "config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = fast.eos_token_id
    config_path.write_text(json.dumps(config, indent=2))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
        gen["eos_token_id"] = fast.eos_token_id
        gen_path.write_text(json.dumps(gen, indent=2))


def make_byte_target(path: str | os.PathLike) -> str:
    """A tiny random Qwen3 target whose vocabulary is the byte tokenizer's, saved with it."""
    from tests.tiny_checkpoints import make_tiny_target

    target = make_tiny_target(path, "qwen3", num_hidden_layers=2, vocab_size=TOKENIZER_VOCAB_SIZE)
    save_byte_tokenizer(target)
    return target


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of ByteLevel pre-tokenization."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}


# -- in-process server ----------------------------------------------------------------------
@dataclasses.dataclass
class InProcessServer:
    base_url: str
    tokenizer_manager: Any
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_in_process(server_args: Any, timeout: float = 300.0) -> InProcessServer:
    """Load the model and serve it with uvicorn in a daemon thread on a free loopback port."""
    from sgl_dflash.entrypoints.http_server import create_app
    from sgl_dflash.managers.tokenizer_manager import TokenizerManager

    tm = TokenizerManager(server_args)
    config = uvicorn.Config(create_app(tm), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return InProcessServer(f"http://127.0.0.1:{port}", tm, server, thread)


# -- subprocess server (the real CLI) -------------------------------------------------------
@dataclasses.dataclass
class SubprocessServer:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cli_server(args: list[str], log_path: Path, timeout: float = 300.0,
                      api_key: str | None = None) -> SubprocessServer:
    """`python -m sgl_dflash.launch_server ARGS --port P`; returns once /health answers 200."""
    port = free_port()
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "sgl_dflash.launch_server", *args, "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=_env_sharing_jax_cache(),
    )
    handle = SubprocessServer(f"http://127.0.0.1:{port}", process, Path(log_path))
    wait_until_up(handle, process, handle.base_url + "/health", timeout, "launch_server")
    return handle


def wait_until_up(server, process: subprocess.Popen, health_url: str, timeout: float, name: str,
                  poll_s: float = 0.5) -> None:
    """Polls `health_url` until it answers 200. A process that exits, or no answer within
    `timeout` seconds (the server is stopped then), raises with the server's log."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{server.log()}")
        try:
            if requests.get(health_url, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{name} did not come up in {timeout}s:\n{server.log()}")
        time.sleep(poll_s)


def _env_sharing_jax_cache() -> dict[str, str]:
    """The environment for a server subprocess: it uses the test session's persistent JAX
    compilation cache when one is configured (same programs, no recompiling)."""
    import jax

    env = dict(os.environ)
    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(jax.config.jax_persistent_cache_min_compile_time_secs)
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = str(jax.config.jax_persistent_cache_min_entry_size_bytes)
    return env


def wait_until_idle(base_url: str, headers: dict[str, str] | None = None, timeout: float = 60.0) -> dict:
    """Poll /server_info until no request is running, waiting or pending; returns the stats."""
    deadline = time.monotonic() + timeout
    while True:
        info = requests.get(base_url + "/server_info", headers=headers, timeout=10).json()
        stats = info["internal_states"][0]
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and info["num_pending_http_requests"] == 0):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {info}")
        time.sleep(0.1)
