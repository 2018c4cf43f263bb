"""jax_backend.host_memory: XLA:CPU's freed temporaries stay in the process (no page faults when
the same program runs again) with SGL_DFLASH_KEEP_FREED_MEMORY=1; by default glibc's malloc is left
as it is (and gives them back)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# A program whose temporaries (two cumulative sums of a 48 MB array) are one large XLA buffer; the
# second run's page faults are what glibc gave back to the kernel after the first.
PROGRAM = textwrap.dedent("""
    import json, resource
    import jax_backend  # first: sets malloc before JAX starts its threads
    from jax_backend import host_memory
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x: (jnp.cumsum(x, 0) * jnp.cumsum(x[::-1], 0)).sum(0))
    x = jnp.ones((3072, 4096), jnp.float32)
    f(x).block_until_ready()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print("RESULT", json.dumps({"applied": host_memory.applied, "faults": faults}))
""")


def _run(keep: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGL_DFLASH_KEEP_FREED_MEMORY"}
    if keep is not None:
        env["SGL_DFLASH_KEEP_FREED_MEMORY"] = keep
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_freed_xla_buffers_are_not_faulted_in_again():
    kept, default = _run("1"), _run(None)
    assert kept["applied"] is True and default["applied"] is False
    # 48 MB of temporaries are ~12k pages of 4 KB when given back (a few dozen huge pages where
    # the kernel backs all anonymous memory with them)
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not (os.path.exists(thp) and "[always]" in open(thp).read()):
        assert default["faults"] > 5000, default
    assert kept["faults"] < 500, kept
