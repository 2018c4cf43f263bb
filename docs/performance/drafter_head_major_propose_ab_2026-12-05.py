"""Interleaved A/B of commit_block + propose at the proposer level: this checkout vs /tmp/base (a worktree of the previous commit), subprocesses alternating; args n x context x block, e.g. 1x300x8 1x1000x8 1x3000x8 8x300x4; env ROUNDS (3); env WORKER=1 builds the proposer as the DFLASH worker does (its target runner's embedding and head, the Q8_0 head blocks for narrow steps, section 47; and the attention kernel where the checkout has it, section 48) (docs/performance.md sections 40 and 45)."""
import json, os, subprocess, sys, numpy as np
from pathlib import Path
HERE = str(Path(__file__).resolve().parents[2])
CODE = r'''
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
                   few_row_matmul=cpu_kernels.rows_matmul, kernel_lm_head=head_blocks,
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
'''
cases = [tuple(map(int, c.split("x"))) for c in sys.argv[1:]]  # n x ctx x block
res = {}
for rnd in range(int(os.environ.get("ROUNDS", 3))):
    for c in cases:
        for name, root in (("base", "/tmp/base"), ("new", HERE)) if rnd % 2 == 0 else (("new", HERE), ("base", "/tmp/base")):
            out = subprocess.run([sys.executable, "-c", CODE, *map(str, c)], cwd=root, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": root, "MODEL": HERE + "/cache/models/SmolLM2-135M-Instruct"})
            line = [l for l in out.stdout.splitlines() if l.startswith("{")]
            if not line: print(out.stderr[-2000:]); sys.exit(1)
            r = json.loads(line[-1]); res.setdefault(c, {}).setdefault(name, []).append(r)
    for c in cases:
        b, nw = res[c]["base"], res[c]["new"]
        print(c, "base", [round(x["ms"], 2) for x in b], "new", [round(x["ms"], 2) for x in nw],
              "same drafts", all(x["drafts"] == b[0]["drafts"] for x in b + nw), flush=True)
