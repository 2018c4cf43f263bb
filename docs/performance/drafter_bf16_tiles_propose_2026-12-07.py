"""Greedy propose at the proposer level, built as the DFLASH worker builds it (WORKER=1), env TILES=1: the bf16 weights on AMX tiles; wall median of 100 and the XLA executables from a jax.profiler trace; args n ctx block (docs/performance.md section 55)."""
import json, os, sys, time, glob, gzip, collections, numpy as np, jax
# The proposer as drafter_head_major_propose_ab_2026-12-05.py builds it, with TILES=1 the worker's AMX setting.
code = open(__file__.replace("drafter_bf16_tiles_propose_2026-12-07", "drafter_head_major_propose_ab_2026-12-05")).read()
code = code.split("CODE = r'''")[1].split("'''")[0].split("for _ in range(5): step()")[0]
tiles = os.environ.get("TILES") == "1"
exec(code.replace("few_row_matmul=cpu_kernels.rows_matmul,", "few_row_matmul=__import__('functools').partial("
                  f"cpu_kernels.rows_matmul, bf16_tiled={tiles}), narrow_layout=cpu_kernels.bf16_tile_order if {tiles} else None,"))
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
