"""The drafter's commit_block + greedy propose with the target's greedy head (`greedy_head.for_drafter`,
over the shipped token map's rows) vs its logits' argmax, two proposers in one process, interleaved,
median of 40 per round; drafts compared. args: n x context x block."""
import json, sys, time
import jax, numpy as np
from jax_backend import TargetRunner, cpu_kernels, greedy_head
from sgl_dflash.speculative.dflash_worker import target_dims
from sgl_dflash.tools.demo import DEFAULT_DRAFTER
from torchax_proposer import DFlashProposer

assert cpu_kernels.available() and cpu_kernels.greedy_head_fast()  # AMX tiles or AVX-512 VNNI
MODEL = "cache/models/SmolLM2-135M-Instruct"
runner = TargetRunner(MODEL, max_total_tokens=64, greedy_head=True)
tmap = json.load(open(DEFAULT_DRAFTER / "token_map.json"))
for case in sys.argv[1:] or ["1x115x8", "1x300x8", "4x115x8"]:
    n, ctx, block = map(int, case.split("x"))
    proposers = {}
    for kind in ("logits", "greedy"):
        proposers[kind] = p = DFlashProposer(
            DEFAULT_DRAFTER, target_embed=runner.embed, target_lm_head=runner.lm_head, target_config=target_dims(MODEL),
            max_num_seqs=8, max_context_len=2100, block_size=8, token_map=tmap, few_row_matmul=cpu_kernels.rows_matmul,
            kernel_lm_head=runner.params["blocks"]["lm_head"], cpu_attention=cpu_kernels.dense_attention,
            greedy_head=greedy_head.for_drafter(runner.params, tmap) if kind == "greedy" else None)
        rng = np.random.default_rng(0)
        for i in range(n):
            p.add(i, rng.standard_normal((ctx, p.num_features)).astype(np.float32))
    rng = np.random.default_rng(1)
    feats = jax.device_put(rng.standard_normal((n, 8, proposers["logits"].num_features)).astype(np.float32))
    ids, bonus = list(range(n)), rng.integers(100, 40000, n)

    def step(p):
        p.commit_block(ids, [1] * n, feats)
        return np.asarray(p.propose(ids, bonus, block_size=block))

    drafts = {kind: [step(p) for _ in range(5)] for kind, p in proposers.items()}
    same = all(np.array_equal(a, b) for a, b in zip(drafts["logits"], drafts["greedy"]))
    for rnd in range(3):
        ms = {}
        for kind in (("logits", "greedy") if rnd % 2 == 0 else ("greedy", "logits")):
            ts = []
            for _ in range(40):
                t0 = time.perf_counter(); step(proposers[kind]); ts.append(time.perf_counter() - t0)
            ms[kind] = float(np.median(ts) * 1e3)
        print(f"{case} round {rnd}: logits {ms['logits']:.2f} ms, greedy {ms['greedy']:.2f} ms "
              f"({ms['greedy'] / ms['logits']:.2f}x), same drafts {same}", flush=True)
