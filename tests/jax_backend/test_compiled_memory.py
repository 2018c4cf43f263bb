"""jax_backend.compiled_memory: the process's room for compiled programs under vm.max_map_count."""

import sys

import jax
import jax.numpy as jnp
import pytest

from jax_backend import compiled_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def test_the_limit_and_the_mappings_are_the_kernels():
    with open("/proc/sys/vm/max_map_count") as f:
        assert compiled_memory.map_limit() == int(f.read())
    before = compiled_memory.maps_in_use()
    held = []
    for i in range(4):  # fresh programs, each a few kernels: each kernel is its own mappings
        fn = jax.jit(lambda x, i=i: (jnp.tanh(x @ x.T + i).sum(0) * jnp.sin(x).mean()))
        fn(jnp.ones((24 + i, 16))).block_until_ready()
        held.append(fn)
    assert compiled_memory.maps_in_use() >= before + 4 * 3
    room = compiled_memory.program_room()
    assert 0 < room <= compiled_memory.map_limit() // compiled_memory.MAPS_PER_PROGRAM


def test_no_limit_to_read_is_no_room_known(monkeypatch, tmp_path):
    monkeypatch.setattr(compiled_memory, "_LIMIT_FILE", tmp_path / "missing")
    assert compiled_memory.map_limit() is None and compiled_memory.program_room() is None
