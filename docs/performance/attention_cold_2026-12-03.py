"""The whole-step attention kernel built with extra -D flags per variant, its KV pool from memory (distinct pools
over 600 MB, more than the L3), one process, 5 interleaved passes, medians, outputs bit-identical
(docs/performance.md section 32; run on the previous source with a -DPF_KV variant, since kept as `prefetch_kv`):

    PYTHONPATH=. python docs/performance/attention_cold_2026-12-03.py "base:" "other:-DFLAG"
"""
import functools, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax_backend import cpu_kernels
from jax_backend.paged_attention import CPU_KERNEL_MAX_Q_LEN, prefix_block_attention
from tests.jax_backend.test_paged_attention import pack_specs
from kernel_variants import build, calling, parse
variants = parse(sys.argv[1:])
labels = [label for label, _ in variants]
names = build("paged_attention.cc", "sgl_dflash_ragged_attention", [flags for _, flags in variants])
assert cpu_kernels.available()
rng = np.random.default_rng(0)
def fn(name, t):
    f = functools.partial(prefix_block_attention, sm_scale=64**-0.5, max_q_len=CPU_KERNEL_MAX_Q_LEN, chunk_tokens=max(t, 16),
                          loop_to_longest=True, cpu_kernel=True)
    return jax.jit(calling("RAGGED_TARGET", name, f))
for seqs, q_len, ctx in [(32, 1, 256), (32, 1, 1024), (4, 8, 256), (1, 16, 256)]:
    heads, kv_heads, dim, page = 9, 3, 64, 16
    pages_per_seq = (ctx + q_len) // page + 1
    pool_bytes = (seqs * pages_per_seq + 1) * page * 2 * kv_heads * dim * 4
    npool = max(2, int(600e6 // pool_bytes))
    pools = [jnp.asarray(rng.standard_normal((seqs * pages_per_seq + 1, page, 2 * kv_heads, dim), np.float32)) for _ in range(npool)]
    page_indices, kv_lens, cu_q_lens = pack_specs([(q_len, ctx + q_len)] * seqs, rng.permutation(np.arange(1, seqs * pages_per_seq + 1)), np.zeros(seqs, np.int32), pages_per_seq, page)
    t = seqs * q_len
    rest = [jnp.asarray(a) for a in (rng.standard_normal((t, heads, dim), np.float32), rng.standard_normal((t, kv_heads, dim), np.float32), rng.standard_normal((t, kv_heads, dim), np.float32))]
    tail = [jnp.asarray(a) for a in (kv_lens, page_indices, cu_q_lens, np.array([seqs], np.int32))]
    fs = {l: fn(n, t) for l, n in zip(labels, names)}
    outs = {l: np.asarray(f(*rest, pools[0], *tail)) for l, f in fs.items()}
    assert all(np.array_equal(o, outs[labels[0]]) for o in outs.values())
    times = {l: [] for l in labels}
    for rep in range(5):
        for l in (labels if rep % 2 else labels[::-1]):
            t0 = time.perf_counter()
            for pool in pools: fs[l](*rest, pool, *tail).block_until_ready()
            times[l].append((time.perf_counter() - t0) / len(pools))
    base = np.median(times[labels[0]]); kv = seqs * ctx * kv_heads * dim * 2 * 4
    print(f"{seqs}x{q_len} ctx {ctx} ({npool} pools): " + "  ".join(f"{l} {1e3*np.median(v):.3f}ms ({np.median(v)/base:.2f})" for l, v in times.items()) + f"  [{kv/base/1e9:.1f} GB/s base]", flush=True)
    del pools
