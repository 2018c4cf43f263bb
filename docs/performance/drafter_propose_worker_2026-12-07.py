"""The proposer as docs/performance/drafter_head_major_propose_ab_2026-12-05.py builds it, alone (exec-ed by drafter_bf16_tiles_propose_2026-12-07.py); env TILES=1: rows_matmul(bf16_tiled=True) and narrow_layout=bf16_tile_order."""

import json, os, sys, time, numpy as np, jax
from jax_backend import cpu_kernels
from jax_backend.loader import load_target
from sgl_dflash.speculative.dflash_worker import target_dims
from sgl_dflash.tools.demo import DEFAULT_DRAFTER
from torchax_proposer import DFlashProposer
cpu_kernels.available()
MODEL = os.environ["MODEL"]
n, ctx, block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tmap = json.load(open(DEFAULT_DRAFTER / "token_map.json"))
if os.environ.get("WORKER") == "1":
    from jax_backend import TargetRunner
    r = TargetRunner(MODEL, page_size=16, max_total_tokens=4096, max_num_seqs=4, max_model_len=1024)
    embed, head, head_blocks = r.embed, r.lm_head, r.params["blocks"]["lm_head"]
else:
    config, params = load_target(MODEL, "float32", None)
    embed, head, head_blocks = params["embed"], params["lm_head"], None
p = DFlashProposer(DEFAULT_DRAFTER, target_embed=embed, target_lm_head=head,
                   target_config=target_dims(MODEL), max_num_seqs=32, max_context_len=8200, block_size=8, token_map=tmap,
                   few_row_matmul=(__import__('functools').partial(cpu_kernels.rows_matmul, bf16_tiled=True) if os.environ.get('TILES') == '1' else cpu_kernels.rows_matmul), kernel_lm_head=head_blocks, **({'narrow_layout': cpu_kernels.bf16_tile_order} if os.environ.get('TILES') == '1' else {}),
                   **({'cpu_attention': cpu_kernels.dense_attention} if os.environ.get('WORKER') == '1' and hasattr(cpu_kernels, 'dense_attention') else {}))
rng = np.random.default_rng(0)
for i in range(n):
    p.add(i, rng.standard_normal((ctx, p.num_features)).astype(np.float32))
feats = jax.device_put(rng.standard_normal((n, 8, p.num_features)).astype(np.float32))
ids = list(range(n)); bonus = rng.integers(100, 40000, n)
def step():
    p.commit_block(ids, [1] * n, feats)
    return p.propose(ids, bonus, return_confidence=True, block_size=block)
for _ in range(5): step()
ts = []
for _ in range(40):
    t0 = time.perf_counter(); out = step(); ts.append(time.perf_counter() - t0)
print(json.dumps({"ms": float(np.median(ts) * 1e3), "drafts": np.asarray(out[0]).tolist()}))
