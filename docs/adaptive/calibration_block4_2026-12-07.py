"""(confidence, outcome) pairs of greedy drafts at block 4 with every draft verified, per position: is the drafter's confidence calibrated on unseen prompts?"""
import sys, json, numpy as np
from types import SimpleNamespace
sys.path.insert(0, ".")
from sgl_dflash.tools.bench_engines import adaptive_engine, resolve_engine_args
from sgl_dflash.tools.bench_concurrency import take_prompts
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
from sgl_dflash.speculative import adaptive as A
args = SimpleNamespace(model_path=None, draft_model_path=None, speculative_token_map=None, adaptive_bound=16,
                       compilation_cache=str(__import__("pathlib").Path("cache/jax_compilation_cache").resolve()))
resolve_engine_args(args)
eng = adaptive_engine(args)
pairs = []
def plan(self, slots, draftable=None):
    self.steps += 1
    return A.DraftPlan(np.ones(len(slots), bool) if draftable is None else np.asarray(draftable, bool), 4)
def choose(self, slots, modes, drafted, confidence, draft_seconds, block=None):
    return np.where(drafted, 3, 0)
orig_observe = A.AdaptivePolicy.observe
def observe(self, slots, modes, drafted, confidence, verified, accepted, block=None):
    if confidence is not None and np.asarray(drafted).any():
        for i in np.flatnonzero(drafted):
            pairs.append((confidence[i, :3].tolist(), int(accepted[i]), tag))
    return orig_observe(self, slots, modes, drafted, confidence, verified, accepted, block)
A.AdaptivePolicy.plan_drafts, A.AdaptivePolicy.choose, A.AdaptivePolicy.observe = plan, choose, observe
w = eng.scheduler.worker
w.policy.realized.min_request_steps = 1 << 30  # never spent
for name in ("mt-bench", "gsm8k"):
    texts, _ = take_prompts(name, 8, start=10)
    tag = name
    for t in texts:
        eng.generate(input_ids=[chat_prompt_ids(eng.tokenizer, t)], sampling_params={"max_new_tokens": 128, "temperature": 0})
json.dump(pairs, open("/tmp/calib_pairs.json", "w"))
for name in ("mt-bench", "gsm8k"):
    P = [(c, a) for c, a, t in pairs if t == name]
    conf = np.array([c for c, _ in P]); acc = np.array([a for _, a in P])
    print(name, "steps", len(P), "mean accepted", acc.mean().round(2))
    for j in range(3):
        live = acc >= j  # position j reached
        ok = acc > j
        c = conf[live, j]; o = ok[live]
        print(f"  pos {j+1}: n {live.sum()} acceptance {o.mean():.2f} mean confidence {c.mean():.2f}")
        for lo in np.arange(0, 1, 0.2):
            m = (c >= lo) & (c < lo + 0.2)
            if m.sum(): print(f"     conf [{lo:.1f},{lo+0.2:.1f}): n {m.sum():4d} acc {o[m].mean():.2f}")
