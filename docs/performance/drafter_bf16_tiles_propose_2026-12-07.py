"""Greedy propose at the proposer level, built as the DFLASH worker builds it (WORKER=1), env TILES=1: the bf16 weights on AMX tiles; wall median of 100 and the XLA executables from a jax.profiler trace; args n ctx block (docs/performance.md section 55)."""
import json, os, sys, time, glob, gzip, collections, numpy as np, jax
exec(open(__file__.replace('bf16_tiles_propose', 'propose_worker')).read().split("for _ in range(5): step()")[0])
for _ in range(10): step()
def go(): return p.propose(ids, bonus, block_size=block)
for _ in range(10): go()
ts = []
for _ in range(100):
    t0 = time.perf_counter(); jax.block_until_ready(go()); ts.append(time.perf_counter() - t0)
d = "/tmp/proftrace_e" + os.environ["TILES"]; os.system(f"rm -rf {d}")
with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(20): jax.block_until_ready(go())
f = glob.glob(d + "/**/*.trace.json.gz", recursive=True)[0]
ev = json.load(gzip.open(f))["traceEvents"]
ex = [e["dur"] for e in ev if e.get("ph") == "X" and e["name"] == "ThunkExecutor::Execute"]
pr = [e["dur"] for e in ev if e.get("ph") == "X" and e["name"].endswith("propose")]
print("TILES", os.environ["TILES"], "wall ms", round(np.median(ts) * 1e3, 3), "executes per propose", len(ex) / 20, "sum us", round(sum(ex) / 20), "largest", sorted(ex)[-3:], "propose us", np.median(pr))
