"""A/B in propose (SmolLM2-135M drafter, token map, 300-row contexts): the drafter's nn.Linear lowered weight-first (jax_drafter.FEW_ROWS = 64, the default) vs x @ W.T (FEW_ROWS = 0),
interleaved pairs; each variant traced into its own JittedDrafter. Kept as run (2026-11-29)."""
import json, time, sys, numpy as np, jax, jax.numpy as jnp, torch, torchax
from torchax import ops
from torchax.ops import ops_registry
from jax_backend.loader import load_target
from sgl_dflash.speculative.dflash_worker import target_dims
from sgl_dflash.tools.demo import DEFAULT_DRAFTER
from torchax_proposer import DFlashProposer
import torchax_proposer.proposer as P, torchax_proposer.jitted as J

VAR = {"barrier": False}
cache = {}
def jd(config, block):
    k = (VAR["barrier"], block)
    if k not in cache:
        cache[k] = J.JittedDrafter(config, block)
    return cache[k]
P.jitted_drafter = jd
from torchax_proposer import jax_drafter
class _Var(dict):
    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        jax_drafter.FEW_ROWS = 64 if v else 0
VAR = _Var(barrier=False)
CALLS = [0]
MODEL = "cache/models/SmolLM2-135M-Instruct"
config, params = load_target(MODEL, "float32", None)
tmap = json.load(open(DEFAULT_DRAFTER / "token_map.json"))
props = []
for barrier in (False, True):
    VAR["barrier"] = barrier
    props.append(DFlashProposer(DEFAULT_DRAFTER, target_embed=params["embed"], target_lm_head=params["lm_head"],
                                target_config=target_dims(MODEL), max_num_seqs=16, max_context_len=1024,
                                block_size=16, token_map=tmap))
rng = np.random.default_rng(0)
feats = [rng.standard_normal((300, props[0].num_features)).astype(np.float32) for _ in range(16)]
for k, p in enumerate(props):
    VAR["barrier"] = bool(k)
    for i, f in enumerate(feats):
        p.add(i, f)
res = {}
for n, B in ((1, 4), (1, 8), (1, 16), (4, 8), (8, 8), (16, 8)):
    ids = list(range(n)); bonus = rng.integers(100, 40000, n)
    outs = []
    for k, p in enumerate(props):
        VAR["barrier"] = bool(k)
        outs.append(p.propose(ids, bonus, return_confidence=True, block_size=B))
    same = bool(np.array_equal(outs[0][0], outs[1][0]))
    conf = float(np.abs(outs[0][1] - outs[1][1]).max())
    ts = ([], [])
    for i in range(40):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            VAR["barrier"] = bool(k)
            t0 = time.perf_counter(); props[k].propose(ids, bonus, return_confidence=True, block_size=B); ts[k].append(time.perf_counter() - t0)
    a, b = np.median(ts[0]) * 1e3, np.median(ts[1]) * 1e3
    pr = float(np.median(np.array(ts[1]) / np.array(ts[0])))
    key = f"n={n} B={B}"
    res[key] = dict(plain_ms=a, barrier_ms=b, ratio=b / a, pair_ratio=pr, same_drafts=same, conf_maxdiff=conf)
    print(f"{key}: x@W.T {a:.2f} ms, barrier {b:.2f} ms, barrier/plain {b/a:.3f}, pair {pr:.3f}, same {same}, conf diff {conf:.1e}", flush=True)
print("linear calls traced", CALLS[0]); print("traces", {k: v.num_traces for k, v in cache.items()})
json.dump(res, open(f"/tmp/ab/drafter_barrier_impl.json", "w"), indent=1)
