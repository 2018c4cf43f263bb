"""`launch_server --dp-size N`: N replicas of this server behind SGLang's router (PyPI
`sglang-router`, the Rust router SGLang users run).

`python -m sglang_router.launch_server` co-launches SGLang's own servers (it imports sglang.srt),
so the same arrangement is made here with this runtime's servers:
1. N `python -m sgl_dflash.launch_server` processes, each a full replica (its own target, drafter
   and KV pool; `--tp-size` devices each), on free loopback ports, with the same flags;
2. once every replica answers /health, the router on --host/--port with `--worker-urls` set to
   them: `sglang_router.launch_router.launch_router(RouterArgs)`, its documented entry point, in a
   child process. Router options are SGLang's co-launch flags, `--router-*` (e.g.
   `--router-policy round_robin`, `--router-retry-max-retries 5`).
This process only supervises: a replica that dies is logged and the router keeps routing to the
others (its health checks and retries decide); when the router exits, or on SIGINT/SIGTERM,
every child is stopped. Across machines, start the servers and the router yourself
(docs/scale.md).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from sgl_dflash.server_args import ServerArgs

logger = logging.getLogger(__name__)
REPLICA_HOST = "127.0.0.1"  # only the router talks to the replicas


def add_router_cli_args(parser: argparse.ArgumentParser) -> None:
    """The router's flags with SGLang's co-launch prefix (`--router-policy`, ...)."""
    from sglang_router.router_args import RouterArgs

    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)


def replica_argv(server_args: ServerArgs, port: int) -> list[str]:
    """Command-line flags that recreate `server_args` for one replica on REPLICA_HOST:port."""
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    argv: list[str] = []
    for action in parser._actions:  # the flags ServerArgs defines, with their defaults
        value = getattr(server_args, action.dest, None)
        if action.dest in ("host", "port", "dp_size") or value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        argv += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return argv + ["--host", REPLICA_HOST, "--port", str(port)]


def replica_env(index: int, tp_size: int) -> dict[str, str]:
    """Replica `index` sees its own tp_size GPUs (SGLang's rule: base_gpu_id = index * tp_size),
    within CUDA_VISIBLE_DEVICES when set. No effect on CPU; TPU hosts: see docs/scale.md."""
    env = dict(os.environ)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range((index + 1) * tp_size)]
    mine = ids[index * tp_size : (index + 1) * tp_size]
    if len(mine) == tp_size:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


def launch_data_parallel(server_args: ServerArgs, cli_args: argparse.Namespace) -> int:
    """Start the replicas and the router; supervise them until the router exits. Exit status."""
    from sglang_router.router_args import RouterArgs

    router_args = RouterArgs.from_cli_args(cli_args, use_router_prefix=True)
    logger.setLevel(logging.INFO)  # where the replicas and the router are: shown at any --log-level
    replicas: list[tuple[subprocess.Popen, str]] = []
    router = None
    # SIGTERM as an exception: the `finally` below stops every child.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for index in range(server_args.dp_size):
            port = _free_port()
            command = [sys.executable, "-m", "sgl_dflash.launch_server", *replica_argv(server_args, port)]
            process = subprocess.Popen(command, env=replica_env(index, server_args.tp_size))
            url = f"http://{REPLICA_HOST}:{port}"
            logger.info("replica %d: pid %d at %s", index, process.pid, url)
            replicas.append((process, url))
        for index, (process, url) in enumerate(replicas):
            if not _wait_healthy(process, url):
                logger.error("replica %d (%s) exited with status %s before serving", index, url, process.returncode)
                return 1

        router_args.worker_urls = [url for _, url in replicas]
        router_args.host, router_args.port = server_args.host, server_args.port
        if router_args.api_key is None:  # the replicas require --api-key: the router sends it
            router_args.api_key = server_args.api_key
        router = multiprocessing.get_context("spawn").Process(target=_run_router, args=(router_args,), name="router")
        router.start()
        logger.info("router: pid %d at http://%s:%d in front of %s", router.pid, server_args.host,
                    server_args.port, " ".join(router_args.worker_urls))
        return _supervise(router, replicas)
    finally:
        _stop(router, replicas)


def _run_router(router_args: Any) -> None:
    from sglang_router.launch_router import launch_router

    launch_router(router_args)


def _supervise(router: multiprocessing.Process, replicas: list[tuple[subprocess.Popen, str]]) -> int:
    reported: set[int] = set()
    while router.is_alive():
        for index, (process, url) in enumerate(replicas):
            if process.poll() is not None and index not in reported:
                reported.add(index)
                logger.warning("replica %d (%s) exited with status %s; the router routes to the others",
                               index, url, process.returncode)
        router.join(timeout=1.0)
    logger.info("router exited with status %s", router.exitcode)
    return 0 if router.exitcode == 0 else 1


def _stop(router: multiprocessing.Process | None, replicas: list[tuple[subprocess.Popen, str]]) -> None:
    if router is not None and router.is_alive():
        router.terminate()
    for process, _ in replicas:
        if process.poll() is None:
            process.terminate()
    for process, _ in replicas:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if router is not None:
        router.join(timeout=10)
        if router.is_alive():
            router.kill()
            router.join()


def _wait_healthy(process: subprocess.Popen, url: str) -> bool:
    """Poll url/health until it answers 200 (True) or the process exits (False)."""
    while process.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except OSError:  # not listening yet (URLError, connection refused, timeout)
            pass
        time.sleep(0.5)
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((REPLICA_HOST, 0))
        return s.getsockname()[1]
