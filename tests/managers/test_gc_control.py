"""Python's garbage collector in a serving process (`managers/gc_control.py`): a server freezes
what startup built (`--disable-gc-freeze` opts out), an Engine on `freeze_gc()`, and
`--gc-warning-threshold-secs` logs long passes."""

from __future__ import annotations

import argparse
import gc
import logging

import pytest

from sgl_dflash import Engine
from sgl_dflash.errors import ServerArgsError
from sgl_dflash.managers import gc_control
from sgl_dflash.managers.tokenizer_manager import TokenizerManager
from sgl_dflash.server_args import ServerArgs


@pytest.fixture
def thawed():
    """Each test starts with nothing frozen (an engine built earlier in this process froze its own)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_server_freezes_what_startup_built_and_an_engine_only_when_asked(tiny_qwen3_dir, thawed):
    """A server's startup objects leave the collector's full passes (`--disable-gc-freeze` opts
    out); an in-process Engine freezes nothing until `freeze_gc()`."""
    engine = Engine(model_path=tiny_qwen3_dir, max_total_tokens=256, skip_tokenizer_init=True)
    assert gc.get_freeze_count() == 0
    alive = [{} for _ in range(500)]
    assert engine.freeze_gc() == gc.get_freeze_count() > 10_000 + len(alive)  # JAX, torch, the model, ...
    assert engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]
    gc.unfreeze()
    opted_out = Engine(model_path=tiny_qwen3_dir, max_total_tokens=256, skip_tokenizer_init=True,
                       disable_gc_freeze=True)
    TokenizerManager(opted_out.server_args, scheduler=opted_out.scheduler)  # the server's front
    assert gc.get_freeze_count() == 0
    TokenizerManager(engine.server_args, scheduler=engine.scheduler)
    assert gc.get_freeze_count() > 10_000


def test_long_collections_are_logged(caplog):
    gc_control.warn_on_long_passes(1e-9)  # every pass is "long"
    try:
        with caplog.at_level(logging.WARNING, logger="sgl_dflash.managers.gc_control"):
            gc.collect()
        assert any("garbage collection of generation 2 took" in r.getMessage() for r in caplog.records)
    finally:
        gc_control.warn_on_long_passes(float("inf"))  # the callback stays installed, silent


def test_gc_flags_parse_and_bad_thresholds_are_refused(tiny_qwen3_dir):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--model-path", tiny_qwen3_dir, "--disable-gc-freeze", "--gc-warning-threshold-secs", "0.25"]))
    assert args.disable_gc_freeze is True and args.gc_warning_threshold_secs == 0.25
    assert ServerArgs.from_cli_args(parser.parse_args(["--model-path", tiny_qwen3_dir])).disable_gc_freeze is False
    for bad in (-1.0, float("nan"), "1", True):
        with pytest.raises(ServerArgsError, match="--gc-warning-threshold-secs must be a number of seconds >= 0"):
            ServerArgs(model_path=tiny_qwen3_dir, gc_warning_threshold_secs=bad).check()
