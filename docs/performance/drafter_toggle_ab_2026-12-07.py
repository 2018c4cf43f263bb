"""In-process A/B of a drafter change behind a temporary switch (its *_toggle_*.diff applied):
two engines with the user's defaults, the switch's env var 0 for one and 1 for the other, greedy
proposes alternating, warm and after a target step; asserts the drafts are identical.

    python drafter_toggle_ab_2026-12-07.py SGL_DFLASH_STACK 120        # section 58
    python drafter_toggle_ab_2026-12-07.py SGL_DFLASH_CACHE_ATTN 300   # section 59
"""
import os, sys, time, json, argparse, numpy as np, jax
from sgl_dflash.tools.bench_engines import _engine, add_engine_args, resolve_engine_args
from jax_backend import SeqInput
p = argparse.ArgumentParser(); add_engine_args(p); args = p.parse_args(["--compilation-cache", "/tmp/jaxcache"]); resolve_engine_args(args)
engines = {}
for flag in ("0", "1"):
    os.environ[sys.argv[1]] = flag
    engines[flag] = _engine(args, speculative_num_draft_tokens=8)
rng = np.random.default_rng(0)
context = int(sys.argv[2]) if len(sys.argv) > 2 else 120
feats = rng.standard_normal((context, engines["0"].scheduler.worker.proposer.num_features)).astype(np.float32)
prompt = rng.integers(0, 1000, context).tolist()
setup = {}
for flag, e in engines.items():
    w = e.scheduler.worker; pr, rn = w.proposer, w.runner
    pr.add("s", feats)
    table = rn.allocator.allocate("s", context + 8)
    rn.forward([SeqInput(prompt, 0, table)])
    setup[flag] = (pr, lambda rn=rn, table=table: rn.sample([SeqInput([7], context, table)], [0.0], [1.0], [0]).tokens)
results = {}
for block in (4, 8):
    outs = {f: np.asarray(setup[f][0].propose(["s"], [11], block_size=block)) for f in setup}
    assert np.array_equal(outs["0"], outs["1"]), (outs)
    for mode in ("warm", "after_target_step"):
        times = {f: [] for f in setup}
        for i in range(300):
            for f in (("0", "1") if i % 2 else ("1", "0")):
                pr, step = setup[f]
                if mode != "warm": jax.block_until_ready(step())
                t = time.perf_counter(); jax.block_until_ready(pr.propose(["s"], [11], block_size=block)); times[f].append(time.perf_counter() - t)
        med = {f: float(np.median(v[20:]) * 1e3) for f, v in times.items()}
        results[f"{block}/{mode}"] = med
        print(f"block {block} {mode}: off {med['0']:.3f} ms, on {med['1']:.3f} ms, ratio {med['1']/med['0']:.3f}", flush=True)
# drafts through a commit + propose cycle equal too
print(json.dumps(results))
