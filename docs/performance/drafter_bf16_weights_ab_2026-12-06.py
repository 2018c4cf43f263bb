"""The drafter's commit_block + propose with its nn.Linear weights read as bfloat16 (the shipped
checkpoint's values, `bfloat16_linear_weights`) vs as float32 (`model_params`), two proposers in
one process, interleaved, median of 40 per round; drafts compared. args: n x context x block.
Needs `git apply docs/performance/drafter_bf16_weights_2026-12-06.diff` (not landed: section 42)."""
import json, sys, time
import jax, numpy as np
from jax_backend import cpu_kernels
from jax_backend.loader import load_target
from sgl_dflash.speculative.dflash_worker import target_dims
from sgl_dflash.tools.demo import DEFAULT_DRAFTER
from torchax_proposer import DFlashProposer
from torchax_proposer.jax_drafter import model_params

assert cpu_kernels.available()
MODEL = "cache/models/SmolLM2-135M-Instruct"
config, params = load_target(MODEL, "float32", None)
tmap = json.load(open(DEFAULT_DRAFTER / "token_map.json"))
for case in sys.argv[1:] or ["1x300x8", "1x1000x8", "8x300x4"]:
    n, ctx, block = map(int, case.split("x"))
    proposers = {}
    for kind in ("float32", "bfloat16"):
        p = DFlashProposer(DEFAULT_DRAFTER, target_embed=params["embed"], target_lm_head=params["lm_head"],
                           target_config=target_dims(MODEL), max_num_seqs=8, max_context_len=2100, block_size=8,
                           token_map=tmap, few_row_matmul=cpu_kernels.rows_matmul)
        if kind == "float32":
            p.params = model_params(p.model)
        rng = np.random.default_rng(0)
        for i in range(n):
            p.add(i, rng.standard_normal((ctx, p.num_features)).astype(np.float32))
        proposers[kind] = p
    rng = np.random.default_rng(1)
    feats = jax.device_put(rng.standard_normal((n, 8, proposers["float32"].num_features)).astype(np.float32))
    ids, bonus = list(range(n)), rng.integers(100, 40000, n)

    def step(p):
        p.commit_block(ids, [1] * n, feats)
        return np.asarray(p.propose(ids, bonus, block_size=block))

    drafts = {kind: [step(p) for _ in range(5)] for kind, p in proposers.items()}
    same = all(np.array_equal(a, b) for a, b in zip(drafts["float32"], drafts["bfloat16"]))
    for rnd in range(3):
        ms = {}
        for kind in (("float32", "bfloat16") if rnd % 2 == 0 else ("bfloat16", "float32")):
            ts = []
            for _ in range(40):
                t0 = time.perf_counter(); step(proposers[kind]); ts.append(time.perf_counter() - t0)
            ms[kind] = float(np.median(ts) * 1e3)
        print(f"{case} round {rnd}: float32 {ms['float32']:.2f} ms, bfloat16 {ms['bfloat16']:.2f} ms "
              f"({ms['bfloat16'] / ms['float32']:.2f}x), same drafts {same}", flush=True)
