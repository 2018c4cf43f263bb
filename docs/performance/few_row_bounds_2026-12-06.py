"""What bounds the few-row products on this CPU (docs/performance.md section 42), two parts:
1. `rows_matmul` (float32 weights) against torch's F.linear (oneDNN/MKL, 2 threads) and XLA's dot
   (YNNPACK) with the weight hot in cache, GFLOP/s, at the shapes a decode / verify / drafter step
   multiplies (1-32 rows) and at a large M for the machine's matmul peak.
2. `rows_matmul_blocks` (GGUF Q4_1 / Q8_0) with its weight hot (one copy) and cold (cycled copies
   beyond the L3): equal times mean the kernel is bound in the core, not by memory.
`python docs/performance/few_row_bounds_2026-12-06.py`"""
import time
import jax, jax.numpy as jnp, numpy as np, torch
from jax_backend import cpu_kernels

assert cpu_kernels.available()
torch.set_num_threads(2)
rng = np.random.default_rng(0)


def timed(fn, reps):
    fn()
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t0) / reps)
    return float(np.median(runs))


kernel, xla = jax.jit(cpu_kernels.rows_matmul), jax.jit(lambda x, w: x @ w.T)
for n, k in [(1536, 576), (576, 1536), (49152, 576)]:
    w = rng.standard_normal((n, k), np.float32)
    wt, wj = torch.from_numpy(w), jnp.asarray(w)
    for rows in (1, 8, 16, 32, 256 if n > 10000 else 1024):
        x = rng.standard_normal((rows, k), np.float32)
        xt, xj = torch.from_numpy(x), jnp.asarray(x)
        reps = 200 if rows <= 32 else 10
        seconds = {"torch": timed(lambda: torch.nn.functional.linear(xt, wt), reps),
                   "xla": timed(lambda: xla(xj, wj).block_until_ready(), reps)}
        if rows <= 64:
            seconds["ours"] = timed(lambda: kernel(xj, wj).block_until_ready(), reps)
        print(f"float32 {n}x{k}, {rows} rows, hot, GFLOP/s:",
              {name: round(2 * n * k * rows / s / 1e9) for name, s in seconds.items()}, flush=True)


def q41(n, k):
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale, offset = ((rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16).astype(np.float32) for _ in range(2))
    return jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(offset)


def q80(n, k):
    codes = rng.integers(-128, 128, (n, k), dtype=np.int8).view(np.uint8)
    return jnp.asarray(codes), jnp.asarray((rng.standard_normal((n, k // 32)) * 0.01).astype(np.float32)), None


from jax_backend.blocks import BlockWeights  # noqa: E402

blocks = jax.jit(cpu_kernels.rows_matmul_blocks)
for maker, n, k, copies in [(q41, 1536, 576, 60), (q41, 576, 1536, 60), (q80, 49152, 576, 2)]:
    weights = [BlockWeights(*maker(n, k)) for _ in range(copies)]
    for rows in (1, 8, 16):
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
        ms = {}
        for name, pool in (("cold", weights), ("hot", weights[:1])):
            it = iter(range(10**9))
            ms[name] = timed(lambda: blocks(x, pool[next(it) % len(pool)]).block_until_ready(), 60)
        print(f"{maker.__name__} {n}x{k}, {rows} rows:",
              ", ".join(f"{name} {s * 1e3:.3f} ms ({2 * n * k * rows / s / 1e9:.0f} GFLOP/s)" for name, s in ms.items()),
              flush=True)
