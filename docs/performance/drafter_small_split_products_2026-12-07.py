"""The bf16 tile products with the small-product rule on and off in one process (apply
drafter_small_split_toggle_2026-12-07.diff first; BF16_SPLIT_ALL set = every product split over
the pool as before), L = 30 copies of each weight cycled in one jitted loop, median of 20 each
(docs/performance.md section 57). Labels: "pool" = split as before, "inline" = the rule."""
import os, sys, time, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "."); sys.path.insert(0, "tests/jax_backend")
from jax_backend import blocks, cpu_kernels
from test_gguf_blocks import random_blocks
assert cpu_kernels.amx_products()
rng = np.random.default_rng(0)
L = int(os.environ.get("L", 30))
def ab(label, fn, args):
    fn(*args).block_until_ready()
    ts = {"0": [], "1": []}
    for it in range(40):
        v = "01"[it % 2]
        if v == "1": os.environ.pop("BF16_SPLIT_ALL", None)
        else: os.environ["BF16_SPLIT_ALL"] = "1"
        t0 = time.perf_counter(); fn(*args).block_until_ready(); ts[v].append(time.perf_counter() - t0)
    os.environ.pop("PU_INLINE", None)
    b, a = np.median(ts["0"]) / L * 1e6, np.median(ts["1"]) / L * 1e6
    print(f"{label}: pool {b:.1f} inline {a:.1f} us ratio {a/b:.2f}", flush=True)
for n, k in ():
    stack = blocks.tile_q4(random_blocks(rng, (L, n, k), "Q4_1"))
    for rows in (1, 4, 8, 32):
        x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
        f = jax.jit(lambda x, s: jax.lax.fori_loop(0, L, lambda i, acc: acc + cpu_kernels.rows_matmul_blocks(x + acc[:, :1] * 0, s, i), jnp.zeros((rows, n), jnp.float32)))
        ab(f"q4 {n}x{k}@{rows}", f, (x, stack))
for n, k in ((576, 576), (192, 576), (1536, 576), (576, 1536), (576, 2880)):
    w = cpu_kernels.bf16_tile_order(jnp.asarray(rng.standard_normal((L, n, k)).astype(np.float32) * 0.05, jnp.bfloat16))
    for rows in (1, 8, 16):
        x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
        f = jax.jit(lambda x, w: jax.lax.fori_loop(0, L, lambda i, acc: acc + cpu_kernels.rows_matmul(x + acc[:, :1] * 0, w, i, bf16_tiled=True), jnp.zeros((rows, n), jnp.float32)))
        ab(f"bf16 {n}x{k}@{rows}", f, (x, w))
