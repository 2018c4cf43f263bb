"""The drafter's propose alone, as the DFLASH worker runs it (issue 12's "drafter propose <= 2 ms").

    python -m sgl_dflash.tools.bench_propose [--blocks 4 8] [--context 120] [--repeats 100]

Builds a DFLASH `Engine` with the user's defaults and times its worker's own proposer (the same
kernels, weight layouts and greedy head the engine drafts with) on one sequence with `--context`
rows of drafter context, greedy, per draft block:
  - warm: proposes back to back (the drafter's weights stay in the caches);
  - after a target step: each propose follows one decode step of the engine's target runner,
    as in serving, where the target's ~100 MB of weights pass through the caches in between.
Only the propose is timed (its device work waited for). Also reads this machine's read bandwidth
(`roofline.measure_machine`) and reports the drafter's weight bytes over it: the propose's floor
when the weights come from memory. Writes <out>/propose.json and <out>/propose.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from sgl_dflash import tools

GOAL_MS = 2.0  # issue 12


def _median_ms(fn, repeats: int, between=None) -> float:
    times = []
    for _ in range(repeats):
        if between is not None:
            jax.block_until_ready(between())
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def measure(engine, blocks: list[int], context: int, repeats: int, progress=None) -> list[dict]:
    """Per draft block: the median propose (ms) warm and after a target decode step."""
    from jax_backend import SeqInput

    worker = engine.scheduler.worker
    proposer, runner = worker.proposer, worker.runner
    rng = np.random.default_rng(0)
    seq = "bench_propose"
    proposer.add(seq, rng.standard_normal((context, proposer.num_features)).astype(np.float32))
    # One target sequence of `context` tokens whose decode step runs between proposes.
    vocab = runner.config.vocab_size
    table = runner.allocator.allocate(seq, context + 8)
    runner.forward([SeqInput(rng.integers(0, vocab, context).tolist(), 0, table)])
    token, bonus = 7 % vocab, 11 % vocab
    target_step = lambda: runner.sample([SeqInput([token], context, table)], [0.0], [1.0], [0]).tokens  # noqa: E731
    rows = []
    try:
        for block in blocks:
            propose = lambda b=block: proposer.propose([seq], [bonus], block_size=b)  # noqa: E731
            for _ in range(5):
                propose(), target_step()
            warm = _median_ms(propose, repeats)
            cold = _median_ms(propose, repeats, between=target_step)
            rows.append({"block": block, "warm_ms": warm, "after_target_step_ms": cold})
            if progress is not None:
                progress.update(1)
    finally:
        proposer.release(seq)
        runner.allocator.free(seq)
    return rows


def drafter_bytes(proposer) -> int:
    """Bytes of the weights a few-row greedy propose reads: its narrow params (the bfloat16
    projections where it keeps them, else the float32 params) and, with the target's greedy head
    (`jax_backend.greedy_head.for_drafter`: (float32 rows, int8 GreedyHead)), the int8 head (the
    float32 rows are read only for the few candidates each row rescores); else its lm_head."""
    head = proposer._greedy[1][1] if proposer._greedy is not None else proposer.lm_head
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves((proposer.narrow_params, head))))


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["warm_ms"] for r in rows], 0.4, label="warm (back to back)")
    ax.bar(x + 0.2, [r["after_target_step_ms"] for r in rows], 0.4, label="after a target decode step")
    ax.axhline(GOAL_MS, color="k", ls="--", lw=1, label=f"issue 12 goal ({GOAL_MS:g} ms)")
    ax.axhline(result["floor_ms"], color="0.5", ls=":", lw=1, label="weights from memory (floor)")
    ax.set_xticks(x, [f"block {r['block']}" for r in rows])
    ax.set_ylabel("ms per propose (median)")
    ax.set_title(f"Drafter propose, one sequence, {result['context']} rows of context")
    ax.legend(fontsize=8)
    return tools.save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    from sgl_dflash.tools.bench_engines import _engine, add_engine_args, resolve_engine_args
    from sgl_dflash.tools.roofline import measure_machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8], help="draft blocks (<= the engine's)")
    parser.add_argument("--context", type=int, default=120, help="rows of drafter context")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    if min(args.blocks) < 2 or args.context < 1 or args.repeats < 1:
        parser.error("--blocks must be >= 2, --context and --repeats >= 1")
    resolve_engine_args(args)
    engine = _engine(args, speculative_num_draft_tokens=max(args.blocks))
    with tqdm(total=len(args.blocks), desc="propose") as progress:
        rows = measure(engine, sorted(args.blocks), args.context, args.repeats, progress)
    machine = measure_machine(jax.default_backend() == "gpu")
    nbytes = drafter_bytes(engine.scheduler.worker.proposer)
    result = {"config": {k: str(v) for k, v in vars(args).items()}, "context": args.context, "machine": machine,
              "drafter_bytes": nbytes, "floor_ms": nbytes / machine["read_bandwidth_gbs"] / 1e6, "goal_ms": GOAL_MS,
              "rows": rows}
    for r in rows:
        print(f"block {r['block']}: warm {r['warm_ms']:.3f} ms, after a target step {r['after_target_step_ms']:.3f} ms "
              f"(goal {GOAL_MS:g}; weights from memory {result['floor_ms']:.3f} ms at "
              f"{machine['read_bandwidth_gbs']:.1f} GB/s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "propose.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "propose.png")
    print(f"wrote {args.out / 'propose.json'} {args.out / 'propose.png'}")
    return result


if __name__ == "__main__":
    main()
