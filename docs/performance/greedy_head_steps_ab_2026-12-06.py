"""The real target's greedy steps with the greedy head kernel against without (one process, two
runners over the same prefilled tokens, steps interleaved pair by pair; engine defaults otherwise:
auto layer loop, GGUF blocks). Cases BxK (env CASES; K = 1: a decode step's sampling program; K > 1: a verify
of K-token blocks). Env CTX (128), STEPS (30). Prints per case the median ms of each and the median
of the pairs' ratios, and asserts equal outputs; writes JSON to argv[1]. REVERSE=1 builds the
logits runner first (the first-built runner's buffers land elsewhere)."""
import json, os, statistics, sys, time
import numpy as np
from jax_backend import SeqInput, TargetRunner
sys.path.insert(0, os.path.dirname(__file__))
from runner_steps import step_fns  # noqa: E402

ctx, steps = int(os.environ.get("CTX", 128)), int(os.environ.get("STEPS", 30))
cases = [tuple(map(int, c.split("x"))) for c in os.environ.get("CASES", "1x1 8x1 16x1 24x1 32x1 1x4 1x8 2x8 1x16 8x4 4x8 4x16").split()]
B = max(b for b, _ in cases)
model = os.path.join(os.path.dirname(__file__), "../../cache/models/SmolLM2-135M-Instruct")
runners, rng = {}, np.random.default_rng(0)
prompts = rng.integers(0, 49152, (B, ctx))
order = (("head", None), ("logits", False))
for name, head in order[::-1] if os.environ.get("REVERSE") else order:  # which runner is built first
    r = TargetRunner(model, page_size=16, max_total_tokens=B * (ctx + 64), max_num_seqs=B, max_model_len=ctx + 32,
                     aux_layer_ids=(1, 8, 14, 20, 27), greedy_head=head)
    assert ("greedy_head" in r.params) == (head is None), "no AMX here: the head is off"
    tables = [r.allocator.allocate(i, ctx + 32) for i in range(B)]
    for g in range(0, B, 4):
        r.forward([SeqInput(prompts[j].tolist(), 0, tables[j]) for j in range(g, min(B, g + 4))])
    runners[name] = (r, tables)
rows = []
for b, k in cases:
    fns, outs = step_fns(runners, rng.integers(0, 49152, (b, k)), ctx)
    same = (np.array_equal(np.asarray(outs["head"].tokens), np.asarray(outs["logits"].tokens)) if k == 1 else
            all(np.array_equal(np.asarray(getattr(outs["head"], f)), np.asarray(getattr(outs["logits"], f)))
                for f in ("accepted", "bonus")))
    assert same, f"{b}x{k}: outputs differ"
    for _ in range(8):
        for f in fns.values():
            f()
    times = {n: [] for n in fns}
    for i in range(steps):
        for n in (("head", "logits") if i % 2 == 0 else ("logits", "head")):
            t0 = time.perf_counter()
            fns[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
    ratio = statistics.median(np.asarray(times["head"]) / np.asarray(times["logits"]))
    rows.append({"case": f"{b}x{k}", "head_ms": statistics.median(times["head"]),
                 "logits_ms": statistics.median(times["logits"]), "pairs_median_ratio": ratio, "same_outputs": same})
    print(rows[-1], flush=True)
if len(sys.argv) > 1:
    json.dump({"ctx": ctx, "steps": steps, "rows": rows}, open(sys.argv[1], "w"), indent=1)
