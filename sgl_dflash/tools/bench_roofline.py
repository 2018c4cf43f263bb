"""The target's steps against this machine's roofline, measured in the same run.

    python -m sgl_dflash.tools.bench_target --roofline [--model-path DIR] [--context 256] [--out-dir bench_results]

1. Measures the machine: read bandwidth (a jitted JAX sum over a large array) and fp32 matmul
   peak (a jitted square matmul), best of several runs.
2. For decode at B = 1, 4, 32 and verify blocks of K = 4, 8, 16 at B = 1, 4, all at `--context`
   cached tokens per sequence, times (median of interleaved repeats, ms per step):
   - ours: `TargetRunner.sample` (decode) / `TargetRunner.verify` (greedy), what the engine runs;
   - on a CPU also "ours_xla_attention" and "ours_xla_matmul": the same runner with XLA's
     attention instead of the CPU attention kernel (`TargetRunner(cpu_attention=False)`), and with
     XLA's dots instead of the CPU matmul kernel (`cpu_matmul=False`): each kernel's gain in one run;
   - a plain dense JAX step over a contiguous KV cache (same weights; the simplest fast JAX);
   - "xla_dots": the step's weight matmuls alone (`dots_step`): what XLA's dot kernels take for
     these shapes, the part of any JAX step that the program around them cannot remove; on a CPU
     also "kernel_dots", the same matmuls through the CPU matmul kernel (what ours runs);
   - transformers eager with a dynamic cache (and, on GPU, with a static cache).
3. Roofline of each case: max(bytes / bandwidth, FLOPs / matmul peak), bytes = weights + KV read
   + KV written, FLOPs = matmuls + attention + lm_head of the logit rows.
Writes roofline.json and roofline.png; prints a table. Runs unchanged on CPU and GPU (JAX CUDA).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_backend import SeqInput, TargetRunner
from jax_backend.model import LayerBranches, apply_rope, final_logits, project, rms_norm, rope_cos_sin, unstack_layers
from sgl_dflash.tools.roofline import measure_machine, roofline, target_bytes, weight_bytes_read  # noqa: F401 (their home)

WARMUP_CALLS = 10  # of ours per step shape: past the layout tuner's exploration (7 steps)
CASES = [(1, 1), (4, 1), (32, 1), (1, 4), (1, 8), (1, 16), (4, 4), (4, 8), (4, 16)]  # (B, K)


def aux_layers(num_layers: int) -> tuple[int, ...]:
    """4 feature layers by z-lab's default rule ([1, 10, 18, 27] for SmolLM2's 30, as our
    drafter): verify returns their features."""
    return tuple(sorted({min(num_layers - 1, max(0, round(1 + i * (num_layers - 4) / 3))) for i in range(4)}))


# -- a plain dense JAX step (contiguous KV cache) ---------------------------------------------------
def dense_step(params, config, k_cache, v_cache, tokens, start):
    """tokens [B, K] at positions start..start+K-1 of every sequence; caches [L, B, S, Hkv, D]."""
    batch, k = tokens.shape
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    positions = start + jnp.arange(k)
    cos, sin = rope_cos_sin(config, positions, params["embed"].dtype)
    key_pos = jnp.arange(k_cache.shape[2])
    visible = key_pos[None, :] <= positions[:, None]  # [K, S]

    def layer(h, xs):
        w, kc, vc = xs
        x = rms_norm(h, w["input_norm"], eps)
        q = (x @ w["q_proj"]).reshape(batch * k, hq, d)
        kn = (x @ w["k_proj"]).reshape(batch * k, hkv, d)
        vn = (x @ w["v_proj"]).reshape(batch, k, hkv, d)
        if config.qk_norm:
            q, kn = rms_norm(q, w["q_norm"], eps), rms_norm(kn, w["k_norm"], eps)
        cos_t, sin_t = jnp.tile(cos, (batch, 1)), jnp.tile(sin, (batch, 1))
        q = apply_rope(q, cos_t, sin_t).reshape(batch, k, hkv, hq // hkv, d)
        kn = apply_rope(kn, cos_t, sin_t).reshape(batch, k, hkv, d)
        kc = jax.lax.dynamic_update_slice_in_dim(kc, kn, start, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, vn, start, axis=1)
        scores = jnp.einsum("bqhgd,bshd->bhgqs", q, kc) * d**-0.5
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("bhgqs,bshd->bqhgd", probs, vc).reshape(batch, k, hq * d)
        h = h + attn @ w["o_proj"]
        x = rms_norm(h, w["post_norm"], eps)
        h = h + (jax.nn.silu(x @ w["gate_proj"]) * (x @ w["up_proj"])) @ w["down_proj"]
        return h, (kc, vc)

    h = params["embed"][tokens]
    h, (k_cache, v_cache) = jax.lax.scan(layer, h, (params["layers"], k_cache, v_cache))
    logits = rms_norm(h, params["norm"], eps) @ params["lm_head"].T
    return logits.astype(jnp.float32), k_cache, v_cache


class DenseJax:
    """`dense_step` with one cache per batch size (contents do not change the cost: zeros)."""

    def __init__(self, runner: TargetRunner, max_len: int):
        layers = runner.params["layers"]  # back to [in, out] where the runner keeps them out-major (a CPU)
        layers = {k.removesuffix("_t"): jnp.swapaxes(v, -1, -2) if k.endswith("_t") else v for k, v in layers.items()}
        self.params, self.config, self.max_len = {**runner.params, "layers": layers}, runner.config, max_len
        self.caches: dict[int, tuple[jax.Array, jax.Array]] = {}
        config = runner.config
        self._step = jax.jit(lambda p, kc, vc, t, s: dense_step(p, config, kc, vc, t, s), donate_argnums=(1, 2))

    def run(self, tokens: np.ndarray, start: int) -> None:
        batch = tokens.shape[0]
        if batch not in self.caches:
            c = self.config
            shape = (c.num_hidden_layers, batch, self.max_len, c.num_key_value_heads, c.head_dim)
            self.caches[batch] = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
        logits, *cache = self._step(self.params, *self.caches[batch], jnp.asarray(tokens), jnp.int32(start))
        self.caches[batch] = tuple(cache)
        np.asarray(logits.argmax(-1))  # greedy ids to the host, as ours


# -- the step's matmuls alone -----------------------------------------------------------------------
def dots_step(params, config, h, vocab_major, cpu_kernel=False):
    """Only the weight matmuls of a step over the rows h [M, H] (every layer's projections and
    the lm_head on every row), chained so that none is dead: no norms, RoPE or attention. What
    XLA's dot kernels alone take for the step's shapes, weights read in place (per-layer arrays,
    no slicing): when this alone is over a goal's multiple of the roofline, the program around
    the dots cannot meet it."""
    for w in params["layers"]:
        mm = functools.partial(project, w, cpu_kernel=cpu_kernel)  # the orientation the runner's steps use
        if "qkv_proj" in w or "qkv_proj_t" in w:
            qkv = mm(h, "qkv_proj")
            q, kv = qkv[:, : config.hidden_size], qkv[:, config.hidden_size :]
        else:
            q, kv = mm(h, "q_proj"), jnp.concatenate([mm(h, "k_proj"), mm(h, "v_proj")], axis=-1)
        h = h + mm(q, "o_proj") + 1e-6 * jnp.mean(kv, axis=-1, keepdims=True)
        if "gate_up_proj" in w or "gate_up_proj_t" in w:
            gate, up = jnp.split(mm(h, "gate_up_proj"), 2, axis=-1)
        else:
            gate, up = mm(h, "gate_proj"), mm(h, "up_proj")
        h = h + mm(jax.nn.silu(gate) * up, "down_proj")
    return final_logits(params, config, h, jnp.arange(h.shape[0]), vocab_major, cpu_kernel)


class DotsOnly:
    """`dots_step` at M = B*K rows with the runner's weights laid out per layer."""

    def __init__(self, runner: TargetRunner, vocab_major: bool, cpu_kernel: bool = False):
        layers = runner.params["layers"]
        layers = list(layers.layers) if isinstance(layers, LayerBranches) else unstack_layers(runner.params)["layers"]
        self.params, self.config = {**runner.params, "layers": layers}, runner.config
        self._step = jax.jit(lambda p, h: dots_step(p, self.config, h, vocab_major, cpu_kernel))

    def run(self, rows: int) -> None:
        h = jnp.full((rows, self.config.hidden_size), 0.01, self.params["embed"].dtype)
        np.asarray(self._step(self.params, h).argmax(-1))  # ids to the host, as ours


# -- transformers ---------------------------------------------------------------------------------
class HfSteps:
    """transformers eager: B sequences of `context` tokens cached, then K-token steps."""

    def __init__(self, hf, context: int, static: bool):
        import torch

        self.torch, self.hf, self.context, self.static = torch, hf, context, static
        self.device = next(hf.parameters()).device
        self.cache, self.batch = None, None

    def _prefill(self, batch: int, max_k: int) -> None:
        torch = self.torch
        ids = torch.randint(0, self.hf.config.vocab_size, (batch, self.context), device=self.device)
        with torch.no_grad():
            self._fill(ids, max_k)
        self.batch = batch

    def _fill(self, ids, max_k: int) -> None:
        torch = self.torch
        from transformers import DynamicCache, StaticCache

        if self.static:
            self.cache = StaticCache(config=self.hf.config, max_cache_len=self.context + max_k)
            positions = torch.arange(self.context, device=self.device)
            self.hf(ids, past_key_values=self.cache, cache_position=positions, use_cache=True)
        else:
            self.cache = DynamicCache()
            self.hf(ids, past_key_values=self.cache, use_cache=True)

    def run(self, tokens: np.ndarray) -> None:
        torch = self.torch
        batch, k = tokens.shape
        if self.batch != batch:
            self._prefill(batch, 16)
        ids = torch.from_numpy(tokens.astype(np.int64)).to(self.device)
        with torch.no_grad():
            if self.static:
                positions = torch.arange(self.context, self.context + k, device=self.device)
                logits = self.hf(ids, past_key_values=self.cache, cache_position=positions, use_cache=True).logits
                _rewind_static(self.cache, self.context)
            else:
                logits = self.hf(ids, past_key_values=self.cache, use_cache=True).logits
                self.cache.crop(self.context - self.cache.get_seq_length())  # negative: drop
            logits.argmax(-1).cpu()


def _rewind_static(cache, length: int) -> None:
    """Back to `length` cached tokens: recent transformers place a StaticCache's writes at its own
    counter (cumulative_length), older ones at the cache_position argument."""
    for layer in getattr(cache, "layers", ()):
        if hasattr(layer, "cumulative_length") and hasattr(layer.cumulative_length, "fill_"):
            layer.cumulative_length.fill_(length)
        if hasattr(layer, "cumulative_length_int"):
            layer.cumulative_length_int = length


# -- the benchmark --------------------------------------------------------------------------------
def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def run(model_dir: str, hf, *, context: int, repeats: int, hf_max_batch: int, out_dir: Path, progress=None,
        hf_static: bool | None = None, layer_loop: str = "auto", fuse_projections: bool = False,
        cases: list[tuple[int, int]] | None = None) -> dict:
    """`hf_static`: also time transformers with a static cache (default: on GPU only).
    `layer_loop` / `fuse_projections`: the TargetRunner layouts to time as "ours".
    `cases`: (B, K) pairs, default `CASES`."""
    cases = CASES if cases is None else cases
    on_gpu = jax.default_backend() != "cpu"
    machine = measure_machine(on_gpu)
    max_batch = max(b for b, _ in cases)
    num_layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    def filled_runner(**kernels) -> tuple[TargetRunner, list]:
        runner = TargetRunner(model_dir, page_size=16, max_total_tokens=max_batch * (context + 32) + 64,
                              max_num_seqs=max_batch, max_model_len=context + 32,
                              aux_layer_ids=aux_layers(num_layers), layer_loop=layer_loop,
                              fuse_projections=fuse_projections, **kernels)
        rng = np.random.default_rng(0)  # the same cached tokens in every runner
        tables = [runner.allocator.allocate(i, context + 32) for i in range(max_batch)]
        for i in range(0, max_batch, 4):  # cache `context` tokens per sequence, 4 sequences a forward
            group = range(i, min(i + 4, max_batch))
            runner.forward([SeqInput(rng.integers(0, runner.config.vocab_size, context).tolist(), 0, tables[j])
                            for j in group])
        return runner, tables

    runner, tables = filled_runner()
    # On a CPU, ours is also timed with XLA's attention, and with XLA's dots: each kernel's gain in one run.
    others = {"ours_xla_attention": filled_runner(cpu_attention=False)} if runner.cpu_attention else {}
    if runner.cpu_matmul:
        others["ours_xla_matmul"] = filled_runner(cpu_matmul=False)
    config = runner.config
    params_bytes = target_bytes(runner)
    rng = np.random.default_rng(1)
    dense = DenseJax(runner, context + 16)
    dots = DotsOnly(runner, vocab_major=not on_gpu)  # the logits' orientation of the runner's steps
    kernel_dots = DotsOnly(runner, vocab_major=True, cpu_kernel=True) if runner.cpu_matmul else None
    impls = {"hf_dynamic": HfSteps(hf, context, static=False)} if hf is not None else {}
    if hf is not None and (on_gpu if hf_static is None else hf_static):
        impls["hf_static"] = HfSteps(hf, context, static=True)

    rows = []
    for batch, k in cases:
        tokens = rng.integers(0, config.vocab_size, (batch, k)).astype(np.int32)
        steps = {"ours": _our_step(runner, tables, tokens, context)}
        steps.update({name: _our_step(r, t, tokens, context) for name, (r, t) in others.items()})
        steps.update({"dense_jax": lambda: dense.run(tokens, context), "xla_dots": lambda: dots.run(batch * k)})
        if kernel_dots is not None:
            steps["kernel_dots"] = lambda: kernel_dots.run(batch * k)
        for name, impl in impls.items():
            if batch <= hf_max_batch:
                steps[name] = lambda impl=impl: impl.run(tokens)
        times = {name: [] for name in steps}
        warmup = {}
        for name, fn in steps.items():  # warm-up: compiles, fills caches, and lets ours settle
            start = time.perf_counter()  # its layer loop (LayoutTuner: 1 + 3 timed steps per layout)
            for _ in range(WARMUP_CALLS if name.startswith("ours") else 2):
                fn()
            warmup[name] = time.perf_counter() - start
        for _ in range(repeats):  # interleaved: every implementation sees the same background load
            for name, fn in steps.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        row = {"batch": batch, "k": k, "kind": "decode" if k == 1 else "verify",
               **roofline(config, params_bytes, batch, k, context, machine),
               "warmup_s": warmup}  # the warm-up calls, the first compiling
        # The same step against the bytes ours reads (GGUF blocks for few rows; else the same).
        read = roofline(config, weight_bytes_read(runner, batch * k), batch, k, context, machine)
        row.update(bytes_read=read["bytes"], roofline_read_ms=read["roofline_ms"], bound_read=read["bound"])
        for name, ts in times.items():
            row[f"{name}_ms"] = _median_ms(ts)
            row[f"{name}_over_roofline"] = row[f"{name}_ms"] / row["roofline_ms"]
        row["ours_over_roofline_read"] = row["ours_ms"] / row["roofline_read_ms"]
        rows.append(row)
        if progress is not None:
            progress(row)

    device = jax.devices()[0]
    result = {
        "backend": jax.default_backend(), "device": getattr(device, "device_kind", str(device)),
        "jax": jax.__version__, "model_path": model_dir, "context": context, "repeats": repeats,
        "params_bytes": params_bytes, "machine": {**machine, "platform": platform.platform(),
                                                  "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
                                                  "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "runner": {"layer_loop": runner.layer_loop, "fuse_projections": runner.fuse_projections,
                   "cpu_attention": runner.cpu_attention,
                   "cpu_matmul": runner.cpu_matmul, "compilations": runner.num_compilations()},
        "rows": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "roofline.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / "roofline.png")
    return result


def _our_step(runner: TargetRunner, tables: list, tokens: np.ndarray, context: int):
    """One greedy step of `runner` for each row of `tokens` [batch, k]: `sample` (k = 1) or `verify`."""
    batch, k = tokens.shape
    if k == 1:
        seqs = [SeqInput([int(t[0])], context, tables[i]) for i, t in enumerate(tokens)]
        return lambda: runner.sample(seqs, [0.0] * batch, [1.0] * batch, [0] * batch)
    seqs = [SeqInput(t.tolist(), context, tables[i], "all") for i, t in enumerate(tokens)]
    return lambda: runner.verify(seqs)


def print_table(result: dict) -> None:
    m = result["machine"]
    print(f"\nbackend {result['backend']} ({result['device']}), read bandwidth {m['read_bandwidth_gbs']:.1f} GB/s, "
          f"fp32 matmul {m['matmul_fp32_gflops']:.0f} GFLOP/s, context {result['context']}")
    names = [n[:-3] for n in result["rows"][0] if n.endswith("_ms") and not n.startswith("roofline")]
    head = f"{'step':<14} {'roofline ms':>11} {'bound':>7} {'read: ms (ours x)':>18} " + " ".join(f"{n + ' ms (x)':>22}" for n in names)
    print(head)
    for row in result["rows"]:
        step = f"B={row['batch']} " + ("decode" if row["k"] == 1 else f"K={row['k']}")
        cells = []
        for n in names:
            value = row.get(f"{n}_ms")
            cells.append(f"{value:>13.2f} ({row[f'{n}_over_roofline']:>5.2f}x)" if value is not None else f"{'-':>22}")
        read = f"{row['roofline_read_ms']:>9.2f} ({row['ours_over_roofline_read']:>5.2f}x)"
        print(f"{step:<14} {row['roofline_ms']:>11.2f} {row['bound']:>7} {read:>18} " + " ".join(cells))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"B{r['batch']}\n" + ("decode" if r["k"] == 1 else f"K{r['k']}") for r in rows]
    names = ["roofline", "roofline_read"] + [n[:-3] for n in rows[0] if n.endswith("_ms") and not n.startswith("roofline")]
    x, width = np.arange(len(rows)), 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(12, 5))
    for i, name in enumerate(names):
        values = [r.get(f"{name}_ms", np.nan) for r in rows]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{result['device']} ({result['backend']}): target steps vs roofline, context {result['context']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
