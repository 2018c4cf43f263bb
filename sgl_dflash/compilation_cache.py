"""JAX's persistent compilation cache, on by default for every engine and server.

A fresh process compiles each program shape it meets (1-5 s per shape on a 2-core CPU; an
adaptive DFLASH engine meets dozens: verify shapes x draft blocks x context buckets). With the
cache a later process loads them instead. Like SGLang's `~/.cache/sglang` for torch.compile, the
default lives under the user's cache root:

  --compilation-cache-dir DIR   (ServerArgs.compilation_cache_dir) this directory;
  $SGL_DFLASH_COMPILATION_CACHE_DIR when the flag is not given;
  $XDG_CACHE_HOME/sgl_dflash/jax_compilation_cache (~/.cache/...) otherwise;
  "none" (or "") turns it off.
A cache directory JAX already has (JAX_COMPILATION_CACHE_DIR, or jax.config set by the caller)
wins over all of these. The cache is keyed by the whole compiled program, so it changes no
result; as JAX warns, only point it at a directory that no untrusted user can write.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "SGL_DFLASH_COMPILATION_CACHE_DIR"
OFF = ("", "none", "off")
# Programs that compile faster than this are not worth a disk entry (JAX's default is 1 s; most
# of this engine's programs compile in 0.5-2 s on a CPU).
MIN_COMPILE_SECONDS = 0.5
MAX_BYTES = 4 << 30  # least recently used entries are evicted past this size


def default_dir() -> str:
    """$SGL_DFLASH_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME (~/.cache)/sgl_dflash/jax_compilation_cache."""
    if ENV_VAR in os.environ:
        return os.environ[ENV_VAR]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "sgl_dflash", "jax_compilation_cache")


def enable(cache_dir: str | None = None) -> str | None:
    """Use `cache_dir` (None: `default_dir()`) as JAX's persistent compilation cache, unless JAX
    already has one. Returns the directory in use, or None when the cache is off (also when the
    directory cannot be created: a warning, never an error; compiling still works)."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = default_dir() if cache_dir is None else os.fspath(cache_dir)
    if path.strip().lower() in OFF:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("compilation cache off: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Only JAX's own defaults are replaced: a caller's settings stay.
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if jax.config.jax_compilation_cache_max_size == -1 and importlib.util.find_spec("filelock"):  # JAX's LRU needs it
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    logger.info("JAX compilation cache: %s", path)
    return path
