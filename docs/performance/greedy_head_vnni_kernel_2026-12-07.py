"""The greedy head kernel alone on a random 49,152 x 576 head: its tokens with the fast sums (AMX tiles or
AVX-512 VNNI) against the Q8_0 blocks' and the float32 weights' logits + argmax, by rows (median of 30)."""
import time, numpy as np, jax, jax.numpy as jnp
from jax_backend import cpu_kernels as ck, greedy_head, sampling
from jax_backend.blocks import BlockWeights
print("fast", ck.greedy_head_fast(), "amx", ck.amx_available())
rng = np.random.default_rng(0)
V, K = 49152, 576
w = jnp.asarray(rng.normal(0, 0.05, (V, K)).astype(np.float32))
head = greedy_head.pack(w)
wb = np.asarray(w).reshape(V, K//32, 32); s = np.abs(wb).max(-1)/127
q8 = BlockWeights(jnp.asarray(np.round(wb/s[...,None]).astype(np.int8).reshape(V,K).view(np.uint8)), jnp.asarray(s.astype(np.float32)))
f_fast = jax.jit(lambda x: ck.greedy_tokens(x, w, head, True))
f_q8 = jax.jit(lambda x: sampling.argmax(ck.rows_matmul_blocks(x, q8)))
f_f32 = jax.jit(lambda x: sampling.argmax(ck.rows_matmul(x, w)))
for rows in (1, 4, 8, 16, 32, 64):
    x = rng.normal(0, 1, (rows, K)).astype(np.float32); x[:, 3] *= 25; x = jnp.asarray(x)
    out = {}
    for name, f in (("vnni head", f_fast), ("q8_0 matmul+argmax", f_q8), ("f32 matmul+argmax", f_f32)):
        f(x).block_until_ready()
        ts = []
        for _ in range(30):
            t = time.perf_counter(); f(x).block_until_ready(); ts.append(time.perf_counter() - t)
        out[name] = 1e3 * np.median(ts)
    assert (np.asarray(f_fast(x)) == np.asarray(f_f32(x))).all()
    print(rows, {k: round(v, 3) for k, v in out.items()}, flush=True)
