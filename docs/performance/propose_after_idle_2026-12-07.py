import sys, time, numpy as np, jax, argparse
from sgl_dflash.tools.bench_engines import _engine, add_engine_args, resolve_engine_args
from jax_backend import SeqInput
p = argparse.ArgumentParser(); add_engine_args(p); args = p.parse_args(["--compilation-cache", "/tmp/jaxcache"]); resolve_engine_args(args)
engine = _engine(args, speculative_num_draft_tokens=8)
w = engine.scheduler.worker; proposer, runner = w.proposer, w.runner
rng = np.random.default_rng(0)
proposer.add("s", rng.standard_normal((120, proposer.num_features)).astype(np.float32))
table = runner.allocator.allocate("s", 128)
runner.forward([SeqInput(rng.integers(0, 1000, 120).tolist(), 0, table)])
step = lambda: runner.sample([SeqInput([7], 120, table)], [0.0], [1.0], [0]).tokens
f = lambda: proposer.propose(["s"], [11], block_size=4)
mode = sys.argv[1]
for _ in range(10): jax.block_until_ready(f()); jax.block_until_ready(step())
def run(n):
    ts = []
    for _ in range(n):
        if mode == "cold": jax.block_until_ready(step())
        elif mode == "sleep": time.sleep(0.009)
        elif mode == "spin":
            e = time.perf_counter() + 0.009
            while time.perf_counter() < e: pass
        elif mode == "sleep1": time.sleep(0.001)
        t = time.perf_counter(); jax.block_until_ready(f()); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e3
print(mode, "median ms", run(100))
jax.profiler.start_trace("/tmp/prof/trace_" + mode)
run(50)
jax.profiler.stop_trace()
