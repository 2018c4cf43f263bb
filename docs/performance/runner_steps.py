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
