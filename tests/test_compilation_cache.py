"""The persistent compilation cache every engine turns on (sgl_dflash/compilation_cache.py)."""

import argparse
import json
import os
import subprocess
import sys

import jax

from sgl_dflash import compilation_cache
from sgl_dflash.server_args import ServerArgs

# One engine in a fresh process: its outputs, the cache directory JAX used, and the cache hits.
SCRIPT = """
import json, sys
import jax
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # tiny programs compile fast: cache all
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
from sgl_dflash.entrypoints.engine import Engine
kwargs, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
engine = Engine(**kwargs)
outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 8})
print(json.dumps({"outputs": [o["output_ids"] for o in outs], "dir": jax.config.jax_compilation_cache_dir,
                  "hits": len(hits)}))
"""


def run_engine(kwargs, prompts, env):
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(kwargs), json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_engine_process_loads_its_programs_from_the_default_cache(tmp_path, engine_kwargs, spec_prompts):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env.pop(compilation_cache.ENV_VAR)  # the default: $XDG_CACHE_HOME/sgl_dflash/jax_compilation_cache
    default = tmp_path / "xdg" / "sgl_dflash" / "jax_compilation_cache"

    first = run_engine(engine_kwargs, spec_prompts, env)
    assert first["dir"] == str(default) and any(default.iterdir())
    second = run_engine(engine_kwargs, spec_prompts, env)
    assert second["hits"] > 0 and second["outputs"] == first["outputs"]

    # "none" turns it off: nothing is read or written.
    off = run_engine({**engine_kwargs, "compilation_cache_dir": "none"}, spec_prompts, env)
    assert off["dir"] is None and off["hits"] == 0 and off["outputs"] == first["outputs"]


def test_default_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_dir() == str(tmp_path / "sgl_dflash" / "jax_compilation_cache")
    monkeypatch.setenv(compilation_cache.ENV_VAR, "/somewhere/else")
    assert compilation_cache.default_dir() == "/somewhere/else"


def test_a_cache_jax_already_has_wins(tmp_path):
    # The test session set one (conftest): an engine asking for another directory keeps it.
    current = jax.config.jax_compilation_cache_dir
    assert current
    assert compilation_cache.enable(str(tmp_path / "other")) == current
    assert jax.config.jax_compilation_cache_dir == current and not (tmp_path / "other").exists()


def test_the_flag_reaches_server_args():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", "--compilation-cache-dir", "none"]))
    assert args.compilation_cache_dir == "none"
    assert ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m"])).compilation_cache_dir is None
