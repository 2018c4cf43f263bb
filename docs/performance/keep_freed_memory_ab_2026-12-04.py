"""A/B of jax_backend.host_memory (docs/performance.md section 36): the target's steps with glibc
keeping freed memory (default) and without (SGL_DFLASH_KEEP_FREED_MEMORY=0), processes alternating.

    python docs/performance/keep_freed_memory_ab_2026-12-04.py --rounds 3 --out docs/performance/keep_freed_memory_ab_2026-12-04.json

Each process: the real SmolLM2-135M target runner (engine-like sizes), a 32-prompt prefill (80-140
tokens each) timed 4 times with 3 s idle before each (a server's prefill after its decode steps;
more than the ~2 s after which this host reports free memory to its hypervisor) and 4 times back
to back, then decode steps at batch 1 / 8 / 32 (context 256, 40 each) and a verify block of 8
tokens at batch 1; medians, page faults per prefill.
"""
import argparse, json, os, resource, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "cache/models/SmolLM2-135M-Instruct"


def child() -> dict:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    from jax_backend import host_memory
    from jax_backend.batch import SeqInput
    from jax_backend.runner import TargetRunner
    rng = np.random.default_rng(0)
    r = TargetRunner(MODEL, max_num_seqs=48, max_model_len=8200, max_total_tokens=16384)
    flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    lens = [int(rng.integers(80, 140)) for _ in range(32)]
    tables = [r.allocator.allocate(i, n + 40) for i, n in enumerate(lens)]
    seqs = [SeqInput(rng.integers(0, 40000, n).tolist(), 0, t, "last") for n, t in zip(lens, tables)]
    r.forward(seqs)
    out = {"keep_freed_memory": host_memory.applied, "prefill_tokens": sum(lens)}
    for name, idle in (("prefill_after_idle", 3.0), ("prefill_back_to_back", 0.0)):
        times, faults = [], []
        for _ in range(4):
            time.sleep(idle)
            f, t = flt(), time.perf_counter()
            r.forward(seqs)
            times.append(time.perf_counter() - t)
            faults.append(flt() - f)
        out[name + "_s"] = float(np.median(times))
        out[name + "_faults"] = int(np.median(faults))
    for i in range(32):
        r.allocator.free(i)
    ctx = 256
    tables = [r.allocator.allocate(i, ctx + 64) for i in range(32)]
    r.forward([SeqInput(rng.integers(0, 40000, ctx).tolist(), 0, t, "last") for t in tables])
    for b in (1, 8, 32):
        dec = [SeqInput([7], ctx, t, "last") for t in tables[:b]]
        args = ([0.0] * b, [1.0] * b, [0] * b)
        for _ in range(5):
            r.sample(dec, *args)
        ts = []
        for _ in range(40):
            t = time.perf_counter(); r.sample(dec, *args); ts.append(time.perf_counter() - t)
        out[f"decode_b{b}_ms"] = 1000 * float(np.median(ts))
    block = [SeqInput(rng.integers(0, 40000, 8).tolist(), ctx, tables[0], "all")]
    for _ in range(3):
        r.forward(block)
    ts = []
    for _ in range(30):
        t = time.perf_counter(); r.forward(block); ts.append(time.perf_counter() - t)
    out["verify_k8_b1_ms"] = 1000 * float(np.median(ts))
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child()))
        return
    runs = []
    for rnd in range(a.rounds):
        for keep in (("1", "0") if rnd % 2 == 0 else ("0", "1")):
            env = {**os.environ, "SGL_DFLASH_KEEP_FREED_MEMORY": keep}
            p = subprocess.run([sys.executable, __file__, "--child", "--out", "-"], env=env, capture_output=True, text=True, check=True)
            row = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
            row["round"] = rnd
            runs.append(row)
            print(json.dumps(row), flush=True)
    keys = [k for k in runs[0] if k.endswith(("_s", "_ms"))]
    summary = {}
    for k in keys:
        on = sorted(r[k] for r in runs if r["keep_freed_memory"])
        off = sorted(r[k] for r in runs if not r["keep_freed_memory"])
        summary[k] = {"keep": on[len(on) // 2], "default_malloc": off[len(off) // 2], "ratio": on[len(on) // 2] / off[len(off) // 2]}
    a.out.write_text(json.dumps({"runs": runs, "median_of_processes": summary}, indent=1))
    for k, v in summary.items():
        print(f"{k}: keep {v['keep']:.3f} default {v['default_malloc']:.3f} ratio {v['ratio']:.3f}")


if __name__ == "__main__":
    main()
