"""Shared by the step A/B scripts here: one decode (k = 1) or verify (k > 1) step per runner over
the same tokens, as a callable each, and each callable's first outputs."""
from jax_backend import SeqInput


def step_fns(runners: dict, tokens, ctx: int) -> tuple[dict, dict]:
    """runners: name -> (TargetRunner, page tables); tokens [batch, k]. (name -> step, name -> outputs)."""
    batch, k = tokens.shape
    fns, outs = {}, {}
    for name, (r, tables) in runners.items():
        if k == 1:
            seqs = [SeqInput([int(t[0])], ctx, tables[i]) for i, t in enumerate(tokens)]
            fns[name] = lambda r=r, seqs=seqs: r.sample(seqs, [0.0] * batch, [1.0] * batch, [0] * batch)
        else:
            seqs = [SeqInput(t.tolist(), ctx, tables[i], "all") for i, t in enumerate(tokens)]
            fns[name] = lambda r=r, seqs=seqs: r.verify(seqs)
        outs[name] = fns[name]()
    return fns, outs


def prefilled_runner(model: str, batch: int, ctx: int):
    """A TargetRunner as the step A/B scripts build it (page size 16, SmolLM2's aux layers) with
    `batch` sequences of `ctx` random prompt tokens prefilled; (runner, page tables, rng)."""
    import numpy as np
    from jax_backend import TargetRunner
    r = TargetRunner(model, page_size=16, max_total_tokens=batch * (ctx + 64), max_num_seqs=batch,
                     max_model_len=ctx + 32, aux_layer_ids=(1, 8, 14, 20, 27))
    rng = np.random.default_rng(0)
    tables = [r.allocator.allocate(i, ctx + 32) for i in range(batch)]
    for g in range(0, batch, 4):
        r.forward([SeqInput(rng.integers(0, 49152, ctx).tolist(), 0, tables[j]) for j in range(g, min(batch, g + 4))])
    return r, tables, rng


def time_cases(r, tables, rng, cases, ctx: int, warmup: int = 8, steps: int = 12) -> dict:
    """Median ms of each (batch, k) case's step after `warmup` steps, and its outputs (decode: the
    tokens; verify: accepted counts and bonus tokens): {"BxK": {"ms", "out"}}."""
    import time
    import numpy as np
    res = {}
    for b, k in cases:
        fns, _ = step_fns({"r": (r, tables)}, rng.integers(0, 49152, (b, k)), ctx)
        for _ in range(warmup):
            o = fns["r"]()
        ts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fns["r"]()
            ts.append(time.perf_counter() - t0)
        out = np.asarray(o.tokens).tolist() if k == 1 else [np.asarray(o.accepted).tolist(), np.asarray(o.bonus).tolist()]
        res[f"{b}x{k}"] = {"ms": float(np.median(ts) * 1e3), "out": out}
    return res
