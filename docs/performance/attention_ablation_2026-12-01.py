"""docs/performance.md section 29: a B=1 step of the real SmolLM2 (switch layer loop) with its attention
replaced by its queries, against the full step and one without aux features; medians in one run.
    python docs/performance/attention_ablation_2026-12-01.py K"""
import sys, time, numpy as np, jax, jax.numpy as jnp
from jax_backend.batch import SeqInput
from jax_backend.runner import TargetRunner
from jax_backend import model
MODEL = "cache/models/SmolLM2-135M-Instruct"
K, ctx = int(sys.argv[1]), 256
r = TargetRunner(MODEL, max_total_tokens=ctx + 64, max_num_seqs=1, max_model_len=ctx + 32, aux_layer_ids=(1, 8, 14, 20, 27), layer_loop="switch")
rng = np.random.default_rng(0)
table = r.allocator.allocate(0, ctx + 32)
r.forward([SeqInput(rng.integers(100, 40000, ctx).tolist(), 0, table)])
batch, _ = r._batch([SeqInput(rng.integers(100, 40000, K).tolist(), ctx, table, "all")])
orig_attn = model.prefix_block_attention
variants = {
  "full": {},
  "no_attention": {"prefix_block_attention": lambda q, k, v, *a, **kw: q},
  "no_aux": "aux",
}
def build(name):
    if name == "no_attention":
        model.prefix_block_attention = lambda q, k, v, *a, **kw: q
    else:
        model.prefix_block_attention = orig_attn
    aux = () if name == "no_aux" else r.aux_layer_ids
    f = jax.jit(lambda p, pool, b: model.forward(p, r.config, pool, b, aux)[0])
    f(r._switch_params, r.kv_pool, batch).block_until_ready()
    return f
fs = {n: build(n) for n in ["full", "no_attention", "no_aux"]}
model.prefix_block_attention = orig_attn
ts = {n: [] for n in fs}
for i in range(30):
    for n, f in fs.items():
        t = time.perf_counter(); f(r._switch_params, r.kv_pool, batch).block_until_ready(); ts[n].append(time.perf_counter() - t)
for n in ts: print(K, n, round(1e3 * float(np.median(ts[n][5:])), 2))
