"""Trace: NONE + adaptive (this commit) serve the A/B's calls (mixed, gsm8k, mt-bench; 1, 8, 32; 2
repeats); log every admission verdict and per call tokens/s, plain fraction, prefill seconds."""
import argparse, collections
from sgl_dflash.tools import bench_batches
from sgl_dflash.tools.bench_concurrency import take_prompts
from sgl_dflash.tools.bench_engines import add_engine_args, make_engines, resolve_engine_args
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
from sgl_dflash.speculative.adaptive import GREEDY
p = argparse.ArgumentParser(); add_engine_args(p); a = p.parse_args(); a.block_sizes = []; resolve_engine_args(a)
engines = make_engines(a)
w = engines["adaptive"].scheduler.worker; pol = w.policy
may_pay = pol.drafts_may_pay
def logged_may_pay(n):
    v = may_pay(n)
    print(f"  may_pay n={n} -> {v} seen={pol.calibrator.drafts_seen(GREEDY):.0f} w={pol.cost.width} win={pol.cost.draft_window} "
          f"prior={pol.typical_gain(n, pol.prior_acceptance):.3f} typical={pol.typical_gain(n):.3f} "
          f"means={pol.calibrator.typical_means(GREEDY)[:3].round(2).tolist()} realized={pol.realized.context_gain(n)}", flush=True)
    return v
pol.drafts_may_pay = logged_may_pay
tok = engines["NONE"].tokenizer
for name in ("mixed", "gsm8k", "mt-bench"):
    texts, _ = take_prompts(name, 82)
    rows = bench_batches.run_batches(engines, [chat_prompt_ids(tok, t) for t in texts], [1, 8, 32], 2, 128)
    for r in rows:
        res = r["results"]
        print(name, r["batch"], r["repeat"], "first", r["first"], {k: (round(v["warm_tokens_per_s"], 1), round(v.get("no_spec_fraction", 1), 2), round(v["prefill_seconds"], 2)) for k, v in res.items()},
              "ratio %.3f" % (res["adaptive"]["warm_tokens_per_s"] / res["NONE"]["warm_tokens_per_s"]), flush=True)
