"""Opt-in (SGL_DFLASH_KEEP_FREED_MEMORY=1): keep the memory XLA:CPU frees in the process, so that
the next step does not fault it in again.

XLA:CPU allocates each execution's temporaries as one buffer (~340 MB for a prefill of 3.5k tokens
of SmolLM2-135M) and frees it when the execution ends. glibc serves such a buffer with its own
mmap and returns it with munmap, so every prefill faults its temporaries in afresh (~83k page
faults here). On a VM with free page reporting (virtio-balloon; this project's Firecracker hosts
report free 8 MB blocks to the hypervisor ~2 s after they are freed) that is dearer still: a
prefill that comes more than ~2 s after the last one re-faults its buffer from the hypervisor, and
ran 5-7% slower than one right after another (docs/performance.md section 36).

`keep_freed_memory` sets glibc's malloc to serve every block from the one main heap and never to
give freed memory back: `M_ARENA_MAX` 1 (a thread's own arena serves blocks over its 64 MB heap
with mmap whatever `M_MMAP_MAX` says), `M_MMAP_MAX` 0 and `M_TRIM_THRESHOLD` at its maximum. The
process then holds the peak of what it allocated, as a server holds its KV cache. Arenas exist
from a thread's first malloc, so it must run before JAX starts its CPU client's threads:
`jax_backend` calls it on import, where the variable is set.

Why not the default: on this host (section 36, three processes each way) it took the 32-prompt
prefill from 4.72 to 4.45 s after 3 s idle (0.94x; 0.96x back to back) and batch-32 decode 0.985x,
but read batch-1 and batch-8 decode steps at 1.04x and a batch-1 verify block of 8 at 1.08x, within
this host's process-to-process spread but all the same way: a server of long prompts at high load
gains, one of single requests (and DFLASH's verify steps) may lose.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

logger = logging.getLogger(__name__)

ENV = "SGL_DFLASH_KEEP_FREED_MEMORY"  # "1": keep freed memory
# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))

applied: bool | None = None  # None: not tried yet; then whether malloc keeps freed memory


def keep_freed_memory() -> bool:
    """Sets glibc's malloc as the module docstring says, once per process. Returns whether it is
    set: False unless SGL_DFLASH_KEEP_FREED_MEMORY=1, off Linux/glibc, or where mallopt refused."""
    global applied
    if applied is not None:
        return applied
    applied = False
    if os.environ.get(ENV, "0") != "1":
        return applied
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return applied
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return applied
    applied = all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
    if not applied:
        logger.warning("mallopt refused to keep freed memory: XLA:CPU steps fault their buffers in each time")
    return applied
