"""The adaptive policy's view at one request: an adaptive Engine serves the mixed set's prompts at the given indices (bench_batches' order) one at a time and logs, per planned step, the first request's acceptance estimates, the plain step's and the drafted shapes' predicted costs (docs/adaptive.md 2026-12-07, bf16 tiles)."""
import sys, time, numpy as np
from types import SimpleNamespace
from sgl_dflash.tools.bench_engines import adaptive_engine, resolve_engine_args
from sgl_dflash.tools.bench_concurrency import take_prompts
from sgl_dflash.speculative import adaptive as A
from sgl_dflash.speculative.cost_model import step_shape
args = SimpleNamespace(model_path=None, draft_model_path=None, speculative_token_map=None, adaptive_bound=16, compilation_cache=str(__import__("pathlib").Path("cache/jax_compilation_cache").resolve()))
resolve_engine_args(args)
eng = adaptive_engine(args)
from sgl_dflash.tools.train.regenerate import chat_prompt_ids
texts, _ = take_prompts("mixed", 27)
log = []
orig = A.AdaptivePolicy.plan_drafts
def plan(self, slots, draftable=None):
    out = orig(self, slots, draftable)
    n = len(slots)
    st = self._state(slots[0])
    plain = self.shape_cost(step_shape(np.ones(n, np.int64)))
    row = dict(block=out.block, est=np.round(st.estimate[:3], 2).tolist(), idle=st.idle, plain_ms=round(plain * 1e3, 2),
               v4=round(self.shape_cost((1, 4, 4)) * 1e3, 2), v2=round(self.shape_cost((1, 2, 2)) * 1e3, 2),
               d2=round(self.draft_cost(n, 2) * 1e3, 2), d4=round(self.draft_cost(n, 4) * 1e3, 2), d8=round(self.draft_cost(n, 8) * 1e3, 2),
               draftable=None if draftable is None else bool(np.asarray(draftable).all()))
    log.append(row)
    return out
A.AdaptivePolicy.plan_drafts = plan
w = eng.scheduler.worker
for idx in [int(i) for i in sys.argv[1:]]:
    log.clear()
    ids = chat_prompt_ids(eng.tokenizer, texts[idx])
    t0 = time.perf_counter()
    out = eng.generate(input_ids=[ids], sampling_params={"max_new_tokens": 128, "temperature": 0})
    print("prompt", idx, "s", round(time.perf_counter() - t0, 2), "steps", len(log), "drafted", sum(r["block"] > 0 for r in log))
    for r in log[:: max(1, len(log) // 25)]: print(r)
    print("calib typical", np.round(w.policy.calibrator.typical_means(0)[:4], 2), "prior", np.round(w.policy.prior_acceptance[:4], 2) if w.policy.prior_acceptance is not None else None)
