"""Why SGL_DFLASH_KEEP_FREED_MEMORY was withdrawn (docs/performance.md section 36b): with glibc's
malloc set to keep freed memory (one arena, no mmap, no trim; the settings of b1ee501), does a
jitted program with ~150 MB of temporaries reuse what its previous run freed? Each process warms
the program 3 times, then counts the page faults and the main heap's growth over 3 more runs.

    python docs/performance/keep_freed_memory_heap_2026-12-05.py --processes 10 --out OUT.json
"""
import argparse
import json
import subprocess
import sys

CHILD = r"""
import ctypes, json, resource, sys
libc = ctypes.CDLL("libc.so.6")
keep = sys.argv[1] == "1"
if keep:  # before JAX starts its threads: M_ARENA_MAX 1, M_MMAP_MAX 0, M_TRIM_THRESHOLD max
    assert all(libc.mallopt(p, v) == 1 for p, v in ((-8, 1), (-4, 0), (-1, 2**31 - 1)))
libc.sbrk.restype = ctypes.c_void_p
import jax, jax.numpy as jnp
f = jax.jit(lambda x: (jnp.cumsum(x, 0) * jnp.cumsum(x[::-1], 0)).sum(0))
x = jnp.ones((3072, 4096), jnp.float32)
for _ in range(3):
    f(x).block_until_ready()
faults, brk = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, libc.sbrk(0)
for _ in range(3):
    f(x).block_until_ready()
print("RESULT", json.dumps({"keep": keep, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                            "heap_growth_mb": (libc.sbrk(0) - brk) / 1e6}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for i in range(args.processes):
        for keep in ("1", "0"):
            out = subprocess.run([sys.executable, "-c", CHILD, keep], capture_output=True, text=True, check=True)
            rows.append(json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))[7:]))
            print(rows[-1], flush=True)
    json.dump({"rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
