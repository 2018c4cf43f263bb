"""Benchmark the JAX target (TargetRunner) against transformers eager on a SmolLM2-135M-shaped
model (Llama, 30 layers, hidden 576, 9/3 heads, vocab 49152, tied; random fp32 weights).

Measures
- autoregressive greedy decode tokens/s: our decode loop vs transformers `generate`;
- the verify-cost curve c(K) = time(forward of K new tokens) / time(forward of 1 token) at a
  fixed context, for both, plus ours/theirs time ratios.

    python -m sgl_dflash.tools.bench_target [--context 512] [--out bench_results/target.json]

With --roofline, instead: every step (decode B = 1/4/32, verify K = 4/8/16 at B = 1/4) against this
machine's roofline measured in the same run, ours vs a plain dense JAX step vs transformers (see
sgl_dflash.tools.bench_roofline); writes roofline.json and roofline.png into --out-dir:

    python -m sgl_dflash.tools.bench_target --roofline [--model-path DIR] [--context 256] [--out-dir bench_results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from jax_backend import SeqInput, TargetRunner
from jax_backend.runner import LAYER_LOOPS

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=100000.0),
)


def build_model(path: Path, num_layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": num_layers})
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path)
    return model


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_decode(runner, hf, prompt, new_tokens, progress) -> dict:
    # Ours: prefill, then one 1-token forward per generated token (greedy on host).
    table = runner.allocator.allocate("ar", len(prompt) + new_tokens + 1)
    out = runner.forward([SeqInput(prompt, 0, table)])
    token = int(out.logits[0][0].argmax())
    runner.forward([SeqInput([token], len(prompt), table)])  # warm-up compile of the decode shape
    ours_tokens = [token]
    start = time.perf_counter()
    for i in range(new_tokens):
        out = runner.forward([SeqInput([ours_tokens[-1]], len(prompt) + i, table)])
        ours_tokens.append(int(out.logits[0][0].argmax()))
        progress.update(1)
    ours_s = time.perf_counter() - start
    runner.allocator.free("ar")

    # transformers: generate(N + 1) - generate(1) isolates N decode steps from the prefill.
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, **kwargs)  # warm-up
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, **kwargs)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        theirs = hf.generate(ids, max_new_tokens=new_tokens + 1, **kwargs)[0, len(prompt) :].tolist()
        theirs_s = time.perf_counter() - start - prefill_s
    progress.update(new_tokens)
    return {
        "new_tokens": new_tokens,
        "ours_tokens_per_s": new_tokens / ours_s,
        "transformers_tokens_per_s": new_tokens / theirs_s,
        "speedup": theirs_s / ours_s,
        "same_greedy_tokens": ours_tokens == theirs,
    }


def bench_verify_curve(runner, hf, context, ks, repeats, progress) -> dict:
    rng = np.random.default_rng(1)
    vocab = runner.config.vocab_size
    prompt = rng.integers(0, vocab, context).tolist()
    table = runner.allocator.allocate("v", context + max(ks))
    runner.forward([SeqInput(prompt, 0, table)])
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values

    rows = []
    for k in ks:
        block = rng.integers(0, vocab, k).tolist()
        seq = [SeqInput(block, context, table, logits="all")]

        def ours_step():
            runner.forward(seq)

        def theirs_step():
            with torch.no_grad():
                hf(torch.tensor([block]), past_key_values=cache, use_cache=True)
            cache.crop(context - cache.get_seq_length())  # roll back to `context` (negative = drop)

        ours_step(), theirs_step()  # warm-up (compiles this bucket)
        ours, theirs = [], []
        for _ in range(repeats):  # interleaved, so both see the same background load
            ours.append(_timed(ours_step))
            theirs.append(_timed(theirs_step))
        rows.append({
            "K": k,
            "ours_s": statistics.median(t[0] for t in ours),
            "transformers_s": statistics.median(t[0] for t in theirs),
            "ours_cpu_s": statistics.median(t[1] for t in ours),
            "transformers_cpu_s": statistics.median(t[1] for t in theirs),
        })
        progress.update(1)
    runner.allocator.free("v")
    base_ours, base_theirs = rows[0]["ours_s"], rows[0]["transformers_s"]
    for row in rows:
        row["ours_cost"] = row["ours_s"] / base_ours
        row["transformers_cost"] = row["transformers_s"] / base_theirs
        row["time_ratio_ours_over_theirs"] = row["ours_s"] / row["transformers_s"]
    return {"context": context, "repeats": repeats, "rows": rows}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="intra-op threads for BOTH frameworks (torch.set_num_threads; XLA single-threaded "
        "Eigen when 1). Default 1: on a shared 2-core machine multi-threaded torch collapses "
        "under contention. 0 keeps each framework's default.",
    )
    parser.add_argument("--out", default="bench_results/target.json")
    parser.add_argument("--roofline", action="store_true", help="run the roofline benchmark instead")
    parser.add_argument("--model-path", default=None,
                        help="--roofline: a real checkpoint (default: random weights, SmolLM2-135M shape)")
    parser.add_argument("--hf-max-batch", type=int, default=None,
                        help="--roofline: largest batch timed with transformers (default 4 on CPU, all on GPU)")
    parser.add_argument("--out-dir", default="bench_results", help="--roofline: where roofline.json/png go")
    parser.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto",
                        help="--roofline: how ours runs the decoder layers (jax_backend/runner.py LAYER_LOOPS)")
    parser.add_argument("--unroll-layers", action="store_true", help="--roofline: --layer-loop unrolled")
    parser.add_argument("--cases", nargs="+", default=None, metavar="BxK",
                        help="--roofline: steps to time, e.g. 1x1 32x1 1x8 (default: B=1/4/32 decode, K=4/8/16 at B=1/4)")
    parser.add_argument("--fuse-projections", action="store_true", help="--roofline: ours with fused qkv/gate_up")
    args = parser.parse_args(argv)
    if args.threads == 1:  # read when the JAX CPU backend starts (first array below)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.roofline:
        return _roofline(args)
    if args.context + max(args.ks) > args.max_model_len:
        parser.error("--context + max(--ks) must fit in --max-model-len")

    with tempfile.TemporaryDirectory() as tmp:
        hf = build_model(Path(tmp), args.layers)
        hf.config._attn_implementation = "eager"
        runner = TargetRunner(
            tmp,
            page_size=args.page_size,
            max_total_tokens=args.max_model_len + 2 * args.page_size,
            max_num_seqs=1,
            max_model_len=args.max_model_len,
        )
    prompt = np.random.default_rng(0).integers(0, SMOLLM2_135M["vocab_size"], args.prompt_len).tolist()
    with tqdm(total=2 * args.new_tokens + len(args.ks), desc="bench_target") as progress:
        decode = bench_decode(runner, hf, prompt, args.new_tokens, progress)
        curve = bench_verify_curve(runner, hf, args.context, args.ks, args.repeats, progress)

    import jax

    result = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "model": "SmolLM2-135M shape (random fp32 weights)",
        "config": {**SMOLLM2_135M, "num_hidden_layers": args.layers},
        "ours": {"page_size": args.page_size, "max_model_len": args.max_model_len, "dtype": "float32"},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "threads_arg": args.threads, "torch_threads": torch.get_num_threads(),
                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "load_average_at_end": os.getloadavg()},
        "decode": decode,
        "verify_curve": curve,
        "compilations": runner.num_compilations(),
    }
    print(f"\nbackend {result['backend']} ({result['device']})")
    print(f"Greedy decode ({args.new_tokens} tokens after a {args.prompt_len}-token prompt):")
    print(f"  ours {decode['ours_tokens_per_s']:.1f} tok/s   transformers {decode['transformers_tokens_per_s']:.1f} tok/s"
          f"   speedup x{decode['speedup']:.2f}   same tokens: {decode['same_greedy_tokens']}")
    print(f"\nVerify cost at context {args.context} (median wall time of {args.repeats}, interleaved):")
    print(f"  {'K':>3} {'ours ms':>9} {'c(K) ours':>10} {'hf ms':>9} {'c(K) hf':>8} {'ours/hf':>8}")
    for row in curve["rows"]:
        print(f"  {row['K']:>3} {row['ours_s'] * 1e3:>9.2f} {row['ours_cost']:>10.2f} "
              f"{row['transformers_s'] * 1e3:>9.2f} {row['transformers_cost']:>8.2f} "
              f"{row['time_ratio_ours_over_theirs']:>8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


# On GPU: capture whole steps (loops included) as XLA command buffers (CUDA graphs). Read when
# the backend starts; ignored by the CPU backend.
GPU_XLA_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL "
                 "--xla_gpu_graph_min_graph_size=1")


def _roofline(args) -> dict:
    from sgl_dflash.tools import bench_roofline

    if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + GPU_XLA_FLAGS).strip()
    import jax

    on_gpu = jax.default_backend() == "gpu"
    device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_path is None:
            hf = build_model(Path(tmp), args.layers)
            model_dir = tmp
        else:
            model_dir = args.model_path
            hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.config._attn_implementation = "eager"
        hf = hf.to(device)
        hf_max_batch = args.hf_max_batch if args.hf_max_batch is not None else (1 << 30 if on_gpu else 4)
        result = bench_roofline.run(
            model_dir, hf, context=args.context, repeats=args.repeats, hf_max_batch=hf_max_batch,
            layer_loop="unrolled" if args.unroll_layers else args.layer_loop,
            fuse_projections=args.fuse_projections,
            cases=None if args.cases is None else [tuple(int(v) for v in c.lower().split("x")) for c in args.cases],
            out_dir=Path(args.out_dir), progress=lambda row: print(f"  B={row['batch']} K={row['k']}: "
                                                                   f"ours {row['ours_ms']:.2f} ms", flush=True),
        )
    result["model"] = args.model_path or "SmolLM2-135M shape (random fp32 weights)"
    result["transformers_device"] = device
    (Path(args.out_dir) / "roofline.json").write_text(json.dumps(result, indent=2))
    bench_roofline.print_table(result)
    print(f"\nwrote {Path(args.out_dir) / 'roofline.json'} and roofline.png")
    return result


if __name__ == "__main__":
    main()
