"""The CPU kernels built for AVX2 (the code machines without AVX-512 run; `-mno-avx512f` builds it
on one that has it): the kernel tests pass with that build, and it gives the same bits as this
machine's own build, so a greedy answer does not depend on which kind of machine served it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_backend import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _env(flags: str) -> dict[str, str]:
    return {**os.environ, cpu_kernels.ENV_FLAGS: flags, "PYTHONPATH": str(ROOT)}


def test_the_avx2_build_passes_the_kernel_tests():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/jax_backend/test_cpu_kernels.py", "tests/jax_backend/test_cpu_matmul.py",
                           "tests/jax_backend/test_gguf_blocks.py", "tests/jax_backend/test_greedy_head.py"],
                          cwd=ROOT, env=_env("-mno-avx512f"), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_the_avx2_build_gives_the_same_bits_as_this_machines(tmp_path):
    results = {}
    for name, flags in [("native", ""), ("avx2", "-mno-avx512f")]:
        out = tmp_path / f"{name}.npz"
        done = subprocess.run([sys.executable, "-m", "tests.jax_backend.kernel_bits", str(out)], cwd=ROOT,
                              env=_env(flags), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[name] = dict(np.load(out))
    native, avx2 = results["native"], results["avx2"]
    assert native.pop("library") != avx2.pop("library")  # two libraries were built and run
    assert sorted(native) == sorted(avx2) and len(native) == 13
    for key in native:
        np.testing.assert_array_equal(avx2[key], native[key], err_msg=key)
