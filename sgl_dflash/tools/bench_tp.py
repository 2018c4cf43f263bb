"""Tensor-parallel overhead and memory of the target (TargetRunner, tp_size = 1, 2, ...).

    python -m sgl_dflash.tools.bench_tp [--tp-sizes 1 2] [--model-path DIR] [--out bench_results/tp.json]

Per tp size, in a fresh process (on CPU with that many virtual devices,
XLA_FLAGS=--xla_force_host_platform_device_count=N; on an accelerator the real devices): the
median time of a greedy decode step (B sequences, one token each) and of a verify step (B blocks
of K tokens) at a fixed context, the weights and KV bytes per device, and whether the greedy
tokens equal tp=1's. On one CPU the N virtual devices are N threads over the same cores, with
all-reduces between them: tp>1 can come out faster (more cores busy than one device keeps busy) or
slower; the numbers check correctness, memory per device and that the partitioned steps run,
they are not a speed claim. Writes JSON (with the load average) and a PNG beside it.
Default model: a random Llama (8 layers, hidden 512, 8/4 heads, MLP 1536, vocab 8192, fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
             tie_word_embeddings=False)


def make_random_llama(out_dir: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.float32).save_pretrained(out_dir)
    return out_dir


def measure(model_path: str, tp: int, batch: int, block: int, context: int, repeats: int) -> dict:
    """Runs inside the process that owns the devices."""
    import jax
    import numpy as np

    from jax_backend import SeqInput, TargetRunner

    runner = TargetRunner(model_path, max_total_tokens=batch * (context + 64), max_num_seqs=batch,
                          max_model_len=context + 64, aux_layer_ids=(1,), tp_size=tp)
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    tables = [runner.allocator.allocate(i, context + 64) for i in range(batch)]
    runner.forward([SeqInput(rng.integers(0, vocab, context).tolist(), 0, t) for t in tables])
    greedy = ([0.0] * batch, [1.0] * batch, [0] * batch)

    def decode(step: int) -> np.ndarray:
        return runner.sample([SeqInput([7 + i], context + step, t) for i, t in enumerate(tables)], *greedy).tokens

    def verify() -> np.ndarray:
        blocks = [SeqInput(rng.integers(0, vocab, block).tolist(), context + 32, t, "all") for t in tables]
        out = runner.verify(blocks)
        jax.block_until_ready(out.features)
        return out.accepted

    tokens = [decode(s).tolist() for s in range(4)]  # also compiles
    verify()
    compiled = runner.num_compilations()
    decode_s, verify_s = [], []
    for r in range(repeats):
        start = time.perf_counter()
        decode(4 + r)
        decode_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        verify()
        verify_s.append(time.perf_counter() - start)
    memory = runner.memory_per_device()
    return {
        "tp": tp, "devices": [str(d) for d in jax.devices()[:tp]], "devices_kind": jax.devices()[0].device_kind,
        "tokens": tokens,
        "decode_ms": 1e3 * statistics.median(decode_s), "verify_ms": 1e3 * statistics.median(verify_s),
        "weights_bytes_per_device": sorted(memory["weights"].values()),
        "kv_bytes_per_device": sorted(memory["kv"].values()),
        "new_compilations": runner.num_compilations() - compiled,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_dflash.tools.bench_tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model-path", default=None, help="target HF dir (default: a random Llama, SHAPE)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=8, help="verify block size K")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench_results/tp.json")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # one tp size, in-process
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(measure(args.model_path, args.worker, args.batch, args.block, args.context, args.repeats)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path or make_random_llama(tmp)
        rows = [_run_worker(model_path, tp, args) for tp in args.tp_sizes]
    base, reference = rows[0], rows[0]["tokens"]
    for row in rows:
        row["tokens_equal_first"] = row.pop("tokens") == reference
        print(f"tp={row['tp']}: decode {row['decode_ms']:.2f} ms/step, verify K={args.block} {row['verify_ms']:.2f} ms, "
              f"weights/device {row['weights_bytes_per_device'][-1] / 2**20:.2f} MiB, "
              f"KV/device {row['kv_bytes_per_device'][-1] / 2**20:.2f} MiB, "
              f"greedy tokens equal tp={base['tp']}: {row['tokens_equal_first']}, "
              f"steady-state compilations: {row['new_compilations']}")
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
              "devices_kind": rows[0]["devices_kind"], "batch": args.batch, "block": args.block,
              "context": args.context, "model": args.model_path or SHAPE, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    plot(report, str(Path(args.out).with_suffix(".png")))
    return 0 if all(row["tokens_equal_first"] for row in rows) else 1


def plot(report: dict, path: str) -> None:
    """Step times (left) and the largest per-device weights / KV share (right) per tp size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"tp={row['tp']}" for row in rows]
    fig, (times, memory) = plt.subplots(1, 2, figsize=(10, 4))
    for offset, (key, name) in enumerate((("decode_ms", "decode step"), ("verify_ms", f"verify K={report['block']}"))):
        times.bar([i + 0.4 * offset for i in range(len(rows))], [row[key] for row in rows], 0.4, label=name)
    times.set(xticks=[i + 0.2 for i in range(len(rows))], xticklabels=labels, ylabel="median ms")
    times.legend()
    for offset, (key, name) in enumerate((("weights_bytes_per_device", "weights"), ("kv_bytes_per_device", "KV pool"))):
        memory.bar([i + 0.4 * offset for i in range(len(rows))], [row[key][-1] / 2**20 for row in rows], 0.4, label=name)
    memory.set(xticks=[i + 0.2 for i in range(len(rows))], xticklabels=labels, ylabel="MiB on the fullest device")
    memory.legend()
    where = (f"{report['devices_kind']} virtual devices on {report['cpus']} cores: not a speed claim"
             if report["devices_kind"] == "cpu" else report["devices_kind"])
    fig.suptitle(f"tensor parallel, {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run_worker(model_path: str, tp: int, args: argparse.Namespace) -> dict:
    # N virtual CPU devices (the flag only shapes the CPU backend; accelerators use their devices).
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}".strip()
    command = [sys.executable, "-m", "sgl_dflash.tools.bench_tp", "--worker", str(tp), "--model-path", model_path,
               "--batch", str(args.batch), "--block", str(args.block), "--context", str(args.context),
               "--repeats", str(args.repeats)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
