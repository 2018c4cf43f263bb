# Needs docs/performance/lazy_verify_head_2026-12-06_late.diff applied (steps.LAZY_HEAD_FIRST). Full vs lazy head, one runner each, interleaved.
import sys, time, numpy as np, jax
sys.path.insert(0, "/work/main")
from jax_backend import SeqInput, TargetRunner, steps
M = "/work/main/cache/models/SmolLM2-135M-Instruct"
ctx = 256
def make(lazy_first):
    steps.LAZY_HEAD_FIRST = lazy_first
    r = TargetRunner(M, page_size=16, max_total_tokens=4 * (ctx + 64), max_num_seqs=2, max_model_len=ctx + 64,
                     aux_layer_ids=(1, 8, 14, 20, 27))
    return r
rng = np.random.default_rng(0)
prompt = rng.integers(0, 49152, ctx).tolist()
runners = {}
for name, first in (("full", 1000), ("lazy", 2)):
    r = make(first)
    t = r.allocator.allocate(0, ctx + 32)
    r.forward([SeqInput(prompt, 0, t)])
    runners[name] = (r, t)
steps.LAZY_HEAD_FIRST = 2
r0, t0 = runners["full"]
greedy = [int(rng.integers(0, 49152))]
for _ in range(16):
    greedy.append(int(r0.forward([SeqInput(greedy, ctx, t0, "all")]).logits[0][-1].argmax()))
for K in (int(k) for k in sys.argv[1:]):
    for passing in (0, 1, 2, 3, K - 1):
        block = greedy[: passing + 1] + [(greedy[passing + 1] + 1) % 49152] + greedy[passing + 2:]
        block = block[:K]
        outs, ts = {}, {n: [] for n in runners}
        for n, (r, t) in runners.items():
            steps.LAZY_HEAD_FIRST = 1000 if n == "full" else 2  # read when a K's program is traced
            for _ in range(3): outs[n] = r.verify([SeqInput(block, ctx, t, "all")])
        steps.LAZY_HEAD_FIRST = 2
        for i in range(30):
            for n in (list(runners) if i % 2 == 0 else list(runners)[::-1]):
                r, t = runners[n]
                s = time.perf_counter(); r.verify([SeqInput(block, ctx, t, "all")]); ts[n].append(time.perf_counter() - s)
        same = all(int(outs["full"].accepted[0]) == int(outs["lazy"].accepted[0]) and int(outs["full"].bonus[0]) == int(outs["lazy"].bonus[0]) for _ in [0])
        m = {n: np.median(v) * 1e3 for n, v in ts.items()}
        print(f"K={K} passing={passing} accepted={int(outs['lazy'].accepted[0])}: full {m['full']:.2f} ms, lazy {m['lazy']:.2f} ms, ratio {m['lazy']/m['full']:.3f}, same {same}", flush=True)
