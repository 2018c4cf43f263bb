"""Data parallel through SGLang's router (PyPI sglang-router): `launch_server --dp-size 2` starts two
replicas and the router in front; concurrent /generate requests through the router give exactly a
single server's outputs, and a replica killed mid-run loses no request (the router retries a
failed attempt on a live replica: the request runs again from the start there).

Tensor parallel end to end: `launch_server --tp-size 2` under two virtual CPU devices serves the
same /generate outputs as a tp=1 server."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.server_harness import _env_sharing_jax_cache, free_port, launch_cli_server, make_byte_target
from tests.tiny_draft import make_tiny_draft

pytestmark = pytest.mark.slow  # several servers: not in the fast lane

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [f"Question {i}: what does {word} do?" for i, word in enumerate(
    ["for", "while", "lambda", "class", "with", "return", "yield", "assert"])]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_byte_target(tmp_path_factory.mktemp("dp_target"))
    draft = str(make_tiny_draft(tmp_path_factory.mktemp("dp_draft"), target, block_size=4))
    return target, draft


def server_flags(pair) -> list[str]:
    target, draft = pair
    return ["--model-path", target, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft,
            "--max-total-tokens", "4096", "--max-running-requests", "8", "--context-length", "512",
            "--log-level", "warning"]


def generate_all(base_url: str, max_new_tokens: int) -> list[tuple[int, str]]:
    """All PROMPTS at once (one thread each); (status, text) per prompt."""
    def one(prompt: str) -> tuple[int, str]:
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                    "ignore_eos": True}}
        response = requests.post(base_url + "/generate", json=body, timeout=600)
        return response.status_code, response.json()["text"] if response.ok else response.text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_router_over_two_replicas_matches_one_server_and_survives_a_killed_replica(pair, tmp_path):
    single = launch_cli_server(server_flags(pair), tmp_path / "single.log")
    try:
        short, long = generate_all(single.base_url, 12), generate_all(single.base_url, 160)
    finally:
        single.stop()
    assert all(status == 200 for status, _ in short + long)

    port = free_port()
    log_path = tmp_path / "dp.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "sgl_dflash.launch_server", *server_flags(pair), "--dp-size", "2",
             "--router-policy", "round_robin", "--router-log-level", "warn", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=dict(_env_sharing_jax_cache(), PYTHONPATH=str(REPO)))
    router = f"http://127.0.0.1:{port}"
    try:
        replicas = wait_for_router(launcher, router, log_path)
        assert len(replicas) == 2
        # Every output through the router equals the single server's.
        assert generate_all(router, 12) == short

        # Kill a replica while it decodes long requests: the router retries the failed attempts on
        # the other replica, so every request still answers 200 with the single server's text.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            results = pool.submit(generate_all, router, 160)
            dead = wait_until_one_runs(replicas, results)
            dead_pid, dead_url = replicas[dead]
            os.kill(dead_pid, signal.SIGKILL)
            assert results.result(timeout=900) == long
        log = log_path.read_text()
        assert f"replica {dead} ({dead_url}) exited with status -9" in log
        assert launcher.poll() is None  # the router and the other replica still serve
        assert generate_all(router, 12) == short
    finally:
        launcher.terminate()
        launcher.wait(timeout=60)
    # The launcher stops its children: the surviving replica's port is closed.
    with pytest.raises(requests.ConnectionError):
        requests.get(replicas[1 - dead][1] + "/health", timeout=5)


def wait_for_router(launcher: subprocess.Popen, router: str, log_path: Path, timeout: float = 600):
    """Wait until the router answers a /generate; returns [(pid, url)] of the replicas."""
    deadline = time.monotonic() + timeout
    while True:
        if launcher.poll() is not None:
            raise AssertionError(f"launcher exited with {launcher.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            probe = requests.post(router + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                                  timeout=30)
            if probe.status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the router did not answer in {timeout}s:\n{log_path.read_text()[-4000:]}")
        time.sleep(1)
    found = re.findall(r"replica (\d+): pid (\d+) at (\S+)", log_path.read_text())
    return [(int(pid), url) for _, pid, url in sorted(found)]


def wait_until_one_runs(replicas, pending: concurrent.futures.Future, timeout: float = 300) -> int:
    """The index of a replica seen with requests running (so that killing it interrupts real work).

    Waiting for both replicas at once raced: on 2 busy cores one replica could finish its share
    before the other's first step, so the kill targets whichever replica is decoding."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not pending.done():
        for index, (_, url) in enumerate(replicas):
            state = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]
            if state["num_running"] > 0:
                return index
        time.sleep(0.02)
    raise AssertionError("no replica was seen running a request before the requests ended")


def test_tp2_server_on_two_virtual_devices_matches_tp1(pair, tmp_path, monkeypatch):
    flags = server_flags(pair)
    one = launch_cli_server(flags, tmp_path / "tp1.log")
    try:
        expected = generate_all(one.base_url, 24)
    finally:
        one.stop()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false "
                                    "intra_op_parallelism_threads=1")
    two = launch_cli_server([*flags, "--tp-size", "2"], tmp_path / "tp2.log")
    try:
        assert generate_all(two.base_url, 24) == expected
        info = requests.get(two.base_url + "/server_info", timeout=10).json()
        assert info["tp_size"] == 2
    finally:
        two.stop()
    assert all(status == 200 for status, _ in expected)


def test_refusals_at_launch(pair, tmp_path):
    def launch(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sgl_dflash.launch_server", *flags], capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))

    target = pair[0]  # 4 query heads, 2 KV heads; this process sees one CPU device
    done = launch("--model-path", target, "--tp-size", "4")
    assert done.returncode == 2 and "--tp-size 4 does not divide the target's num_key_value_heads (2)" in done.stderr
    done = launch("--model-path", target, "--tp-size", "2")
    assert done.returncode == 2 and "tp_size 2 needs 2 devices, but JAX sees 1" in done.stderr
    done = launch("--model-path", target, "--router-policy", "random")  # router flags need --dp-size
    assert done.returncode == 2 and "--router-policy" in done.stderr
    done = launch("--model-path", target, "--dp-size", "0")
    assert done.returncode == 2 and "--dp-size must be an integer >= 1, got 0" in done.stderr
