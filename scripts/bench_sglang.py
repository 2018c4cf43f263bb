"""Tokens/s of one target + drafter pair through SGLang's launcher (`python -m
sglang.launch_server --device cpu`, our dflash_jax platform) vs our own `python -m
sgl_dflash.launch_server`, at concurrency 1 and 16, greedy DFLASH. Writes JSON.

    .venv/bin/python scripts/bench_sglang.py [--model-path M --draft D] [--out bench_results/sglang.json]

Each server runs alone (one after the other), warmed up at both concurrencies first (JAX compiles
per batch-size bucket), then timed: `concurrency` clients each send `requests_per_client`
requests of `max_new_tokens` tokens (ignore_eos). tokens/s = completion tokens / wall seconds;
`cpu_s` is the server process tree's CPU time during the timed part (the machine is shared: wall
numbers move with other people's load; tokens per CPU second much less).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SGL_DFLASH_CACHE", ROOT / "cache"))
PROMPTS = ["Write a short story about a robot.", "Explain how a bicycle works.", "List five fruits and their colors.",
           "What is the capital of France? Answer in a sentence.", "Describe the water cycle.",
           "Give three tips for learning Python.", "Why is the sky blue?", "Summarize the plot of Cinderella."]


def launch(front_door: str, model: str, draft: str, port: int, log: Path) -> subprocess.Popen:
    module = "sglang.launch_server" if front_door == "sglang" else "sgl_dflash.launch_server"
    args = [sys.executable, "-m", module, "--model-path", model, "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", draft, "--host", "127.0.0.1", "--port", str(port),
            "--max-running-requests", "16", "--max-total-tokens", "8192", "--log-level", "warning"]
    if front_door == "sglang":
        args += ["--device", "cpu"]
    else:
        args += ["--page-size", "16"]
    process = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{module} exited:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except requests.RequestException:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"{module} did not come up")


def chat_ids(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def run_clients(port: int, prompts: list[list[int]], concurrency: int, per_client: int, max_new_tokens: int) -> list[dict]:
    def client(c: int) -> list[dict]:
        return [requests.post(f"http://127.0.0.1:{port}/generate", timeout=3600, json={
            "input_ids": prompts[(c * per_client + k) % len(prompts)],
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        }).json() for k in range(per_client)]

    with cf.ThreadPoolExecutor(concurrency) as pool:
        return [out for outs in pool.map(client, range(concurrency)) for out in outs]


def cpu_seconds(process: subprocess.Popen) -> float:
    root = psutil.Process(process.pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def measure(front_door: str, args, prompts) -> dict:
    port = 30500 + (front_door == "sglang")
    process = launch(front_door, args.model_path, args.draft, port, Path(args.out).with_suffix(f".{front_door}.log"))
    rows = {}
    try:
        for concurrency in (1, 16):  # warm-up: compile every batch bucket both runs meet
            run_clients(port, prompts, concurrency, 1, 8)
        for concurrency, per_client in ((1, args.requests_c1), (16, 1)):
            cpu0, t0 = cpu_seconds(process), time.perf_counter()
            outs = run_clients(port, prompts, concurrency, per_client, args.max_new_tokens)
            wall, cpu = time.perf_counter() - t0, cpu_seconds(process) - cpu0
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
            rows[f"c{concurrency}"] = {
                "requests": len(outs), "tokens": tokens, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                "tokens_per_s": round(tokens / wall, 2), "tokens_per_cpu_s": round(tokens / max(cpu, 1e-9), 2),
                "accept_length": round(tokens / verify, 3) if verify else None,
            }
            print(front_door, concurrency, rows[f"c{concurrency}"], flush=True)
        rows["outputs"] = [o["output_ids"] for o in outs]
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=str(CACHE / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--draft", default=str(ROOT / "sgl_dflash" / "assets" / "smollm2-135m-dflash"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests-c1", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "bench_results" / "sglang_vs_ours.json"))
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    prompts = chat_ids(args.model_path)
    results = {door: measure(door, args, prompts) for door in ("ours", "sglang")}
    same = results["ours"].pop("outputs") == results["sglang"].pop("outputs")
    report = {"model": args.model_path, "draft": args.draft, "max_new_tokens": args.max_new_tokens,
              "greedy_outputs_equal_at_c16": same, "load_average": os.getloadavg(), **results}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
