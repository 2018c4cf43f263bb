"""Runs the fuzz of `tests/entrypoints/fuzz.py` against a live server and reports.

    python scripts/fuzz_server.py --requests 5000          # starts its own server (tiny pair)
    python scripts/fuzz_server.py --url http://host:30000 --api-key KEY --requests 5000

Exit status 0 when there was no 5xx, no hang, no malformed error body, no good request whose
output differed from the clean run, and the server ended healthy and idle.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.entrypoints.fuzz import Target, hand_written_requests, schemathesis_requests


@dataclasses.dataclass
class Report:
    requests: int = 0
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    server_errors: list[str] = dataclasses.field(default_factory=list)  # 5xx, 5xx events, resets
    hangs: list[str] = dataclasses.field(default_factory=list)
    bad_bodies: list[str] = dataclasses.field(default_factory=list)  # 4xx not in the API's format
    max_latency_s: float = 0.0
    max_latency_4xx_s: float = 0.0
    seconds_by_status: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    good_requests: int = 0
    good_mismatches: list[str] = dataclasses.field(default_factory=list)
    healthy_after: bool | None = None

    @property
    def ok(self) -> bool:
        return not (self.server_errors or self.hangs or self.bad_bodies or self.good_mismatches) and bool(
            self.healthy_after)

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "statuses": dict(sorted(self.statuses.items())),
                "5xx": len(self.server_errors), "hangs": len(self.hangs), "bad_error_bodies": len(self.bad_bodies),
                "max_latency_s": round(self.max_latency_s, 3), "max_latency_4xx_s": round(self.max_latency_4xx_s, 3),
                "seconds_by_status": {k: round(v, 1) for k, v in sorted(self.seconds_by_status.items())},
                "good_requests": self.good_requests, "good_mismatches": len(self.good_mismatches),
                "healthy_after": self.healthy_after,
                "examples": (self.server_errors + self.hangs + self.bad_bodies + self.good_mismatches)[:5]}


class Fuzzer:
    def __init__(self, target: Target, timeout_s: float):
        self.target = target
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.report = Report()

    def send(self, method: str, path: str, headers: dict[str, str], body: bytes | None) -> None:
        what = f"{method} {path} {body[:200]!r}" if body is not None else f"{method} {path}"
        start = time.perf_counter()
        try:
            r = self.session.request(method, self.target.base_url + path, headers=headers, data=body,
                                     timeout=self.timeout_s)
            content = r.content
        except requests.Timeout:
            self.report.hangs.append(what)
            return
        except requests.ConnectionError as e:
            self.report.server_errors.append(f"connection failed ({e}): {what}")
            self.session = requests.Session()
            return
        finally:
            self.report.requests += 1
        latency = time.perf_counter() - start
        self.report.max_latency_s = max(self.report.max_latency_s, latency)
        self.report.statuses[r.status_code] += 1
        self.report.seconds_by_status[r.status_code] += latency
        if latency > self.timeout_s:
            self.report.hangs.append(f"{latency:.1f}s: {what}")
        if r.status_code >= 500:
            self.report.server_errors.append(f"{r.status_code} {content[:300]!r}: {what}")
        elif r.status_code >= 400:
            self.report.max_latency_4xx_s = max(self.report.max_latency_4xx_s, latency)
            problem = error_body_problem(path, content)
            if problem:
                self.report.bad_bodies.append(f"{r.status_code} {problem}: {content[:200]!r}: {what}")
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            problem = stream_problem(content)
            if problem:
                self.report.server_errors.append(f"stream: {problem}: {what}")


def error_body_problem(path: str, content: bytes) -> str | None:
    """None when `content` is an error body in the format of `path`'s API."""
    try:
        body = json.loads(content)
    except ValueError:
        return "not JSON"
    if path.startswith("/v1/"):
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not {
                "type", "param", "code"} <= set(error):
            return "not OpenAI's error format"
    elif not (isinstance(body, dict) and body.get("object") == "error" and isinstance(body.get("message"), str)):
        return "not SGLang's error format"
    return None


def stream_problem(content: bytes) -> str | None:
    events = [line[len(b"data: "):] for line in content.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return "did not end with [DONE]"
    for event in events[:-1]:
        error = json.loads(event).get("error")
        if isinstance(error, dict) and int(error.get("code") or 0) >= 500:
            return f"error event {error}"
    return None


# -- well-formed requests running beside the fuzz -------------------------------------------
def good_requests(model: str) -> list[tuple[str, dict[str, Any]]]:
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = [{"role": "user", "content": "Hi."}]
    return [
        ("/generate", {"text": "A good request", "sampling_params": greedy}),
        ("/generate", {"text": "A good stream", "sampling_params": greedy, "stream": True}),
        ("/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": greedy}),
        ("/v1/completions", {"model": model, "prompt": "Good completion", "max_tokens": 8, "temperature": 0}),
        ("/v1/chat/completions", {"model": model, "messages": chat, "max_tokens": 8, "temperature": 0,
                                  "stream": True}),
    ]


def outcome(response: requests.Response) -> Any:
    """What must not change: output ids and text (a stream: its final event / its joined deltas)."""
    assert response.status_code == 200, response.text
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        body = response.json()
        if isinstance(body, list):
            return [(o["output_ids"], o.get("text")) for o in body]
        if "choices" in body:
            return [c["text"] for c in body["choices"]]
        return body["output_ids"], body.get("text")
    events = [json.loads(e[6:]) for e in response.text.split("\n") if e.startswith("data: {")]
    if "choices" in events[0]:
        return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    return events[-1]["output_ids"], events[-1].get("text")


class GoodClients:
    """Threads sending well-formed greedy requests in a loop, each output compared with the
    clean run's (taken before the fuzz starts, on the same server)."""

    def __init__(self, target: Target, report: Report, num_threads: int):
        self.target, self.report = target, report
        self.headers = {} if target.api_key is None else {"Authorization": f"Bearer {target.api_key}"}
        self.cases = good_requests(target.models[0])
        self.reference = [outcome(self._post(path, body)) for path, body in self.cases]
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(num_threads)]

    def _post(self, path: str, body: dict[str, Any]) -> requests.Response:
        return requests.post(self.target.base_url + path, json=body, headers=self.headers, timeout=120)

    def _loop(self, offset: int) -> None:
        i = offset
        while not self.stop.is_set():
            k = i % len(self.cases)
            try:
                got = outcome(self._post(*self.cases[k]))
            except Exception as e:  # a failure is a finding, not a crash of the runner
                got = f"{type(e).__name__}: {e}"
            with self.lock:
                self.report.good_requests += 1
                if got != self.reference[k]:
                    self.report.good_mismatches.append(f"{self.cases[k]}: {got!r} != {self.reference[k]!r}")
            i += 1

    def __enter__(self) -> "GoodClients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)


def run_fuzz(target: Target, num_requests: int, *, random_seed: int = 0, timeout_s: float = 60.0,
             good_threads: int = 2) -> Report:
    headers = {} if target.api_key is None else {"Authorization": f"Bearer {target.api_key}"}
    spec = requests.get(target.base_url + "/openapi.json", headers=headers, timeout=30).json()
    fuzzer = Fuzzer(target, timeout_s)
    strategy = st.one_of(hand_written_requests(target), schemathesis_requests(target, spec))

    @seed(random_seed)
    @settings(max_examples=num_requests, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(request: tuple[str, str, dict[str, str], bytes | None]) -> None:
        fuzzer.send(*request)

    with GoodClients(target, fuzzer.report, good_threads):
        while fuzzer.report.requests < num_requests:  # hypothesis may stop a little short
            one()
            random_seed += 1
    fuzzer.report.healthy_after = healthy_and_idle(target.base_url, headers)
    return fuzzer.report


def healthy_and_idle(base_url: str, headers: dict[str, str]) -> bool:
    from tests.server_harness import wait_until_idle

    if requests.get(base_url + "/health", timeout=10).status_code != 200:
        return False
    if requests.get(base_url + "/health_generate", timeout=60).status_code != 200:
        return False
    stats = wait_until_idle(base_url, headers, timeout=120)
    return stats["num_free_pages"] == stats["total_pages"]


# -- command line ---------------------------------------------------------------------------
FUZZ_SERVER_FLAGS = ["--page-size", "8", "--max-total-tokens", "512", "--max-running-requests", "8",
                     "--served-model-name", "fuzz-model", "--log-level", "error"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="fuzz this server (default: start one on a tiny random model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="served model name (default: /v1/models)")
    parser.add_argument("--vocab-size", type=int, default=264)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds after which a request is a hang")
    parser.add_argument("--good-clients", type=int, default=2)
    parser.add_argument("--context-length", type=int, default=64, help="of the server started here")
    args = parser.parse_args(argv)
    server = None
    if args.url is None:
        from tests.server_harness import launch_cli_server, make_byte_target

        workdir = Path(tempfile.mkdtemp(prefix="sgl_dflash_fuzz_"))
        args.api_key = args.api_key or "sk-fuzz"
        server = launch_cli_server(["--model-path", make_byte_target(workdir / "target"), *FUZZ_SERVER_FLAGS,
                                    "--context-length", str(args.context_length), "--api-key", args.api_key], workdir / "server.log")
        args.url = server.base_url
    try:
        headers = {} if args.api_key is None else {"Authorization": f"Bearer {args.api_key}"}
        model = args.model or requests.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        target = Target(args.url, args.api_key, [model, "default"], args.vocab_size)
        start = time.perf_counter()
        report = run_fuzz(target, args.requests, random_seed=args.seed, timeout_s=args.timeout,
                          good_threads=args.good_clients)
        print(json.dumps({**report.summary(), "wall_s": round(time.perf_counter() - start, 1)}, indent=2))
    finally:
        if server is not None:
            server.stop()
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
