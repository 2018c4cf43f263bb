"""Issue 14 at one request: NONE, fixed B=4 and the adaptive engine serve the same mixed prompts one
at a time (a closed loop of 1, engines stepping in turn: `bench_concurrency.serve`), after one
unmeasured warm-up prompt; per prompt the steady tokens/s, whether every output equals NONE's, and
what the adaptive policy decided (draft blocks planned, requests released as spent), then the
admission checks (`drafts_may_pay`: typical gain, typical acceptance) and every 25th plan (plain
step ms, draft ms per block, the request's estimate and bias) in order.
`python docs/adaptive/batch1_policy_trace_2026-12-06.py --n 8 --start 40`"""
import argparse
import collections

from sgl_dflash.tools.bench_concurrency import serve, take_prompts
from sgl_dflash.tools.bench_engines import add_engine_args, make_engines, resolve_engine_args
from sgl_dflash.tools.train.regenerate import chat_prompt_ids

parser = argparse.ArgumentParser()
add_engine_args(parser)
parser.add_argument("--block-sizes", type=int, nargs="*", default=[4])
parser.add_argument("--n", type=int, default=8)
parser.add_argument("--start", type=int, default=40)
parser.add_argument("--tokens", type=int, default=128)
args = parser.parse_args()
resolve_engine_args(args)
engines = make_engines(args)
policy = engines["adaptive"].scheduler.worker.policy
counts, events = collections.Counter(), []
may_pay, spent, plan_drafts = policy.drafts_may_pay, policy.realized.spent, policy.plan_drafts


def logged_may_pay(n):
    verdict = may_pay(n)
    events.append(("may_pay", n, verdict, round(policy.typical_gain(n), 3),
                   policy.calibrator.typical_means(0).round(3).tolist()))
    return verdict


def logged_spent(slot, cost):
    verdict = spent(slot, cost)
    counts["spent"] += verdict
    return verdict


def logged_plan(slots, draftable=None):
    plan = plan_drafts(slots, draftable)
    counts[f"block{plan.block}"] += 1
    if counts["plans"] % 25 == 0:
        state = policy.requests.get(slots[0])
        events.append(("plan", plan.block, round(policy.plain_seconds(len(slots)) * 1e3, 2),
                       {b: round(policy.draft_cost(len(slots), b) * 1e3, 2) for b in policy.blocks},
                       None if state is None else state.estimate.round(2).tolist(),
                       None if state is None else round(state.bias, 2)))
    counts["plans"] += 1
    return plan


policy.drafts_may_pay, policy.realized.spent, policy.plan_drafts = logged_may_pay, logged_spent, logged_plan
tokenizer = engines["NONE"].tokenizer
serve(engines, [chat_prompt_ids(tokenizer, take_prompts("mixed", 1, 0)[0][0])], 1, args.tokens)  # warm-up
prompts, _ = take_prompts("mixed", args.n, args.start)
for i, prompt in enumerate(prompts):
    before = dict(counts)
    row = serve(engines, [chat_prompt_ids(tokenizer, prompt)], 1, args.tokens)
    same = all(r["outputs"] == row["NONE"]["outputs"] for r in row.values())
    rates = {name: (round(r["steady_tokens_per_s"], 1), r.get("no_spec_fraction")) for name, r in row.items()}
    print(i, prompt[:40].replace("\n", " "), rates, "same", same,
          {k: counts[k] - before.get(k, 0) for k in counts}, flush=True)
for event in events:
    print(event)
