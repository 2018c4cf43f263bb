"""`python -m sglang.launch_server ... --device cpu` in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys

import requests

from tests.server_harness import free_port, wait_until_up


class SGLangServer:
    def __init__(self, args: list[str], log_path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", *args, "--device", "cpu", "--host", "127.0.0.1",
             "--port", str(self.port)],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=dict(os.environ),
        )
        wait_until_up(self, self.process, self.base_url + "/health_generate", 600, "sglang.launch_server", poll_s=1)

    def log(self) -> str:
        return open(self.log_path, errors="replace").read()

    def stop(self) -> None:
        self.process.terminate()  # SGLang's launcher takes its scheduler and detokenizer down with it
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def generate(self, **body) -> dict:
        response = requests.post(self.base_url + "/generate", json=body, timeout=600)
        assert response.status_code == 200, response.text
        return response.json()
