"""Shared, session-scoped tiny checkpoints (built once; JAX compilations are then shared too)."""

import pytest

from tests.tiny_checkpoints import make_tiny_target


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("qwen3_target"), "qwen3", num_hidden_layers=2)
