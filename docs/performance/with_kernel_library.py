"""Runs a module with the CPU kernels loaded from a given library (one built from an earlier
commit's sources, or for another instruction set) instead of the one `cpu_kernels.build()` makes:

    python docs/performance/with_kernel_library.py LIB.so sgl_dflash.tools.bench_dflash ARGS...

(docs/performance.md section 31: the Engine's roofline check before and after a kernel change.)"""
import pathlib, runpy, sys
from jax_backend import cpu_kernels
so = pathlib.Path(sys.argv[1])
cpu_kernels.build = lambda: so
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
