"""A fresh swept adaptive engine serving mixed batches as bench_batches does (1, then 8 prompts):
per decode step the policy's predicted cost of what it chose and of the plain step, and the actual."""
import json, sys, time
import numpy as np
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.tools import model_import
from sgl_dflash.tools.demo import DEFAULT_DRAFTER, use_compilation_cache
from sgl_dflash.tools.bench_concurrency import serve, take_prompts
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
from sgl_dflash.speculative.cost_model import step_shape
from sgl_dflash import tools
use_compilation_cache(tools.CACHE_DIR / "jax_compilation_cache")
mp = str(model_import.ensure_default_model())
dataset = sys.argv[1]
eng = Engine(model_path=mp, random_seed=0, speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
             speculative_num_draft_tokens=16, speculative_adaptive=True)
w = eng.scheduler.worker; pol = w.policy; cost = pol.cost
for n in (1, 2, 4, 8):
    sh = step_shape(np.ones(n, np.int64)); v2 = step_shape(np.full(n, 2)); v3 = step_shape(np.full(n, 3))
    print("after sweep n", n, "plain", sh, round(cost.verify(sh) * 1e3, 1), "verify2", v2, round(cost.verify(v2) * 1e3, 1),
          "verify3", v3, round(cost.verify(v3) * 1e3, 1), "draft b2/b4/b8", [round(cost.draft(n, b) * 1e3, 1) for b in pol.blocks], flush=True)
log, cur = [], {}
orig_decode, orig_choose = w.forward_decode, pol.choose
def choose(slots, modes, drafted, confidence, draft_seconds, block=None):
    k = orig_choose(slots, modes, drafted, confidence, draft_seconds, block)
    cur["pred"] = draft_seconds + pol.shape_cost(step_shape(k + 1)); cur["draft_s"] = draft_seconds; cur["k"] = int(k.sum())
    cur["shape"] = step_shape(k + 1); cur["block"] = block
    return k
def decode(batch):
    t = time.perf_counter()
    cur.clear(); cur["n"] = len(batch.slots); cur["plain_pred"] = pol.step_cost(np.ones(len(batch.slots), np.int64))
    cur["ctx"] = int(max(batch.prefix_lens)); c0 = w._compilations()
    r = orig_decode(batch)
    cur["s"] = time.perf_counter() - t; cur["compiled"] = w._compilations() != c0; cur["speed"] = cost.speed
    log.append(dict(cur)); return r
w.forward_decode, pol.choose = decode, choose
texts, _ = take_prompts(dataset, 82)
prompts = [chat_prompt_ids(eng.tokenizer, t) for t in texts]
for name, batch in (("b1", prompts[:1]), ("b8", prompts[1:9])):
    start = len(log)
    row = serve({"adaptive": eng}, batch, len(batch), 128)
    print(name, "tokens/s", round(row["adaptive"]["tokens"] / row["adaptive"]["seconds"], 1), "may_pay", [pol.drafts_may_pay(n) for n in (1, 2, 4, 8)], flush=True)
    for s in log[start:]:
        print(f"  n={s['n']} ctx={s['ctx']} k={s.get('k', 0)} shape={s.get('shape')} block={s.get('block')} actual {s['s']*1e3:.0f} pred {s.get('pred', 0)*1e3:.0f} "
              f"(draft {s.get('draft_s', 0)*1e3:.0f}) plain_pred {s['plain_pred']*1e3:.0f} speed {s['speed']:.2f}{' COMPILED' if s['compiled'] else ''}")
json.dump(log, open(f"/tmp/ab2/diag_b8_{dataset}.json", "w"), default=str)
