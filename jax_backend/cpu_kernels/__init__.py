"""Hand-written XLA:CPU kernels, built on first use with the machine's C++ compiler.

`ragged_attention` is `paged_attention.prefix_block_attention` (the model's attention of decode
and verify steps) as one XLA custom call, the CPU's counterpart of the Pallas kernel slot on
TPU/GPU: it reads each cached K/V row once, in place, where XLA's own gathers copy every page chunk
before its dots read it, and it needs none of XLA's small ops around them (query layout, block
merges), which cost more than the attention itself at 8-16 queries per sequence.
`paged_prefix_attention` is the cached-prefix part alone (`ragged_paged_attention`, other head sizes).
`rows_matmul` is the few-row product x @ w.T of decode and verify steps (`model.project`): it
streams each weight row from memory once, where XLA:CPU's few-row dots read weights at a fraction
of the bandwidth, and gives every row bit-identical sums whatever the number of rows.

`greedy_tokens` is the argmax of `rows_matmul`'s logits of the lm_head without computing most of them
exactly (int8 sums on AMX tiles or with AVX-512 VNNI bound every logit; the few that may be the largest
are computed exactly).

The shared library is compiled from `paged_attention.cc`, `rows_matmul.cc` and `greedy_head.cc` (g++ or $CXX, `-O3 -march=native`,
against the XLA FFI headers jaxlib ships) into $SGL_DFLASH_KERNEL_DIR, else
$XDG_CACHE_HOME (~/.cache)/sgl_dflash/cpu_kernels, keyed by the source, the compiler, its flags,
jaxlib's version and the CPU's features: a few seconds once per machine. Where that cannot be
done (no compiler, a read-only cache) `available()` is False, a warning says why, and callers
keep the pure-JAX path.
`SGL_DFLASH_CPU_KERNELS=0` turns the kernels off; `SGL_DFLASH_KERNEL_FLAGS` adds compiler flags
(`-mno-avx512f` builds, on an AVX-512 CPU, the AVX2 code that other machines run).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jax_backend.blocks import BlockWeights, TiledQ4

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention.cc", "rows_matmul.cc", "greedy_head.cc"))
HEADERS = (Path(__file__).with_name("common.h"),)
TARGET = "sgl_dflash_paged_prefix_attention"
MATMUL_TARGET = "sgl_dflash_rows_matmul"
BLOCKS_TARGET = "sgl_dflash_rows_matmul_blocks"
BF16_TARGET = "sgl_dflash_rows_matmul_bf16"
RAGGED_TARGET = "sgl_dflash_ragged_attention"
DENSE_TARGET = "sgl_dflash_dense_attention"
CACHE_TARGET = "sgl_dflash_cache_attention"
GREEDY_TARGET = "sgl_dflash_greedy_head"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno", "-fopenmp-simd")
ENV_OFF = "SGL_DFLASH_CPU_KERNELS"
ENV_DIR = "SGL_DFLASH_KERNEL_DIR"
ENV_FLAGS = "SGL_DFLASH_KERNEL_FLAGS"  # extra compiler flags, e.g. -mno-avx512f: this CPU builds the AVX2 code


def kernel_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "sgl_dflash" / "cpu_kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_features() -> str:
    """What `-march=native` compiles for: a library built on one CPU may not run on another that
    shares the cache directory (AVX-512 on some of these machines, AVX2 only on others)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.machine() + platform.processor()


def build() -> Path:
    """The compiled library's path, compiling it first where this key (source, compiler, flags,
    jaxlib, CPU) has none."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    flags = (*FLAGS, *os.environ.get(ENV_FLAGS, "").split())
    key = hashlib.sha1("\n".join([*(source.read_text() for source in SOURCES + HEADERS), version, " ".join(flags), jaxlib.__version__,
                                  _cpu_features()]).encode())
    path = kernel_dir() / f"sgl_dflash_kernels-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"compiling {', '.join(s.name for s in SOURCES)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def available() -> bool:
    """Whether the CPU kernels are built and registered with XLA (once per process)."""
    if os.environ.get(ENV_OFF, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    try:
        library = ctypes.CDLL(str(build()))
        for target in (TARGET, MATMUL_TARGET, BLOCKS_TARGET, BF16_TARGET, RAGGED_TARGET, DENSE_TARGET, CACHE_TARGET,
                       GREEDY_TARGET):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        logger.warning("CPU kernels unavailable, using XLA's attention and matmuls: %s", e)
        return False
    _library.append(library)
    return True


_library: list[ctypes.CDLL] = []  # the loaded kernels, once `available()`


ENV_AMX = "SGL_DFLASH_AMX"  # 0: no AMX tiles (the FMA kernels, as CPUs without AMX compute)


def _amx_allowed() -> bool:
    return os.environ.get(ENV_AMX, "1") != "0"


@functools.cache
def amx_available() -> bool:
    """Whether the greedy head runs AMX tiles here: the kernels are built with them (an Intel CPU
    with AMX-INT8), Linux grants this process the tile state, and SGL_DFLASH_AMX is not 0."""
    return available() and _amx_allowed() and bool(_library[0].sgl_dflash_greedy_head_amx())


@functools.cache
def vnni_available() -> bool:
    """Whether the greedy head's int32 sums can run with AVX-512 VNNI here (AMD Zen 4, Intel Ice
    Lake on: the kernels are built with it); AMX tiles go first where they run."""
    return available() and bool(_library[0].sgl_dflash_greedy_head_vnni())


def greedy_head_fast() -> bool:
    """Whether the greedy head's int32 sums run on AMX tiles or with AVX-512 VNNI here, not as plain
    code (`greedy_head.attach`'s default)."""
    return amx_available() or vnni_available()


@functools.cache
def amx_products() -> bool:
    """Whether Q4_1 products can run on AMX tiles here (`blocks.TiledQ4`: float32-accurate, not the
    FMA kernel's bits): built with AMX-BF16, granted, SGL_DFLASH_AMX not 0."""
    return available() and _amx_allowed() and bool(_library[0].sgl_dflash_amx_products())


def paged_prefix_attention(q, kv_pages, page_indices, limit, num_seqs, *, sm_scale: float, mask_value: float):
    """Online-softmax state (m, l [S, Hkv, G, Q], acc [S, Hkv, G, Q, D], float32) of queries
    q [S, Q, Hkv, G, D] over cache positions < limit[s, j] of each sequence's pages (float32
    only; call `available()` first)."""
    s, qm, hkv, g, d = q.shape
    state = jax.ShapeDtypeStruct((s, hkv, g, qm), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, (state, state, jax.ShapeDtypeStruct((s, hkv, g, qm, d), jnp.float32)))
    return call(q, kv_pages, page_indices.astype(jnp.int32), limit.astype(jnp.int32), num_seqs.astype(jnp.int32),
                sm_scale=np.float32(sm_scale), mask_value=np.float32(mask_value))


def ragged_attention(queries, new_keys, new_values, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                     sm_scale: float, mask_value: float):
    """`paged_attention.prefix_block_attention` in one call: [T, Hq, D] float32 outputs of packed
    ragged queries over each sequence's cached prefix (in the pages) and, causally, the step's new
    keys/values [T, Hkv, D]; padding rows are zeros. Head size 64 or 128, float32; call
    `available()` first."""
    call = jax.ffi.ffi_call(RAGGED_TARGET, jax.ShapeDtypeStruct(queries.shape, jnp.float32))
    i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    return call(queries, new_keys, new_values, kv_pages, i32(page_indices), i32(cu_q_lens), i32(kv_lens),
                i32(num_seqs), sm_scale=np.float32(sm_scale), mask_value=np.float32(mask_value))


def dense_attention(query, key, value, attn_mask=None, *, scale: float | None = None):
    """F.scaled_dot_product_attention(query, key, value, attn_mask, scale=scale) for float32
    query [N, H, R, D], key / value [N, H, S, D] (head size 64 or 128) and a boolean mask
    broadcast as [N, 1, 1 or R, S] (True = may attend; None = all): each row gathers only the
    keys it may see, with the paged kernels' online softmax; a row that sees no key gives NaN as
    torch's does. The drafter's attention on a CPU (`torchax_proposer`'s `cpu_attention`). Call
    `available()` first."""
    n, _, rows, dim = query.shape
    keys = key.shape[2]
    mask = jnp.ones((n, 1, 1, keys), jnp.bool_) if attn_mask is None else attn_mask
    if mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] not in (1, rows):
        raise ValueError(f"dense_attention: mask of shape {mask.shape} is not [N, 1, 1 or {rows}, {keys}]")
    mask = jnp.broadcast_to(mask, (n, 1, mask.shape[2], keys))
    call = jax.ffi.ffi_call(DENSE_TARGET, jax.ShapeDtypeStruct(query.shape, jnp.float32))
    return call(query, key, value, mask, sm_scale=np.float32(dim**-0.5 if scale is None else scale))


def cache_attention(query, k_cache, v_cache, slots, lens, k_block, v_block, *, scale: float | None = None):
    """`dense_attention` of query [N, H, R, D] over each sequence's cached keys and then its block's,
    the cache read in place: k_cache / v_cache [S, H, T, D] (head-major), sequence n's keys rows
    0 .. lens[n] - 1 of slot slots[n], then every row of k_block / v_block [N, H, B, D]. The same
    bits as `dense_attention` over those rows gathered and concatenated (a mask allowing them),
    without gathering them. Float32, head size 64 or 128; call `available()` first."""
    call = jax.ffi.ffi_call(CACHE_TARGET, jax.ShapeDtypeStruct(query.shape, jnp.float32))
    return call(query, k_cache, v_cache, jnp.asarray(slots, jnp.int32), jnp.asarray(lens, jnp.int32), k_block, v_block,
                sm_scale=np.float32(query.shape[-1] ** -0.5 if scale is None else scale))


def rows_matmul(x, w, layer=None, bf16_tiled: bool = False):
    """x [R, K] @ w.T as float32 [R, N], for out-major weights w [N, K], or w[layer].T for a layer
    stack w [L, N, K] and a traced layer index (the stack is read in place: no slice is copied).
    x float32; w float32, or bfloat16 read as such and computed as its exact float32 values (the
    bits of w.astype(float32) from half the bytes; K % 32 == 0), or GGUF blocks
    (`rows_matmul_blocks`: the bits of their float32 weights; `TiledQ4` too). `bf16_tiled`: bfloat16
    weights are in `bf16_tile_order` and summed on AMX tiles (at most 64 rows, where
    `amx_products()`: float32-accurate, not the FMA kernel's bits; a row's bits the same alone or
    among others). Call `available()` first."""
    if isinstance(w, (BlockWeights, TiledQ4)):
        return rows_matmul_blocks(x, w, layer)
    if layer is None:
        w, layer = w[None], 0
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    if w.dtype == jnp.bfloat16:  # widened in the kernel, or on tiles
        if bf16_tiled and (x.shape[0] > 64 or not amx_products()):
            raise ValueError(f"rows_matmul: bf16 weights in tile order need AMX and at most 64 rows, got {x.shape[0]}")
        return jax.ffi.ffi_call(BF16_TARGET, out)(x, w, layer, tiles=np.int32(bf16_tiled))
    return jax.ffi.ffi_call(MATMUL_TARGET, out)(x, w, layer)


def bf16_tile_order(w):
    """bfloat16 weights [.., N, K] (N % 16 == 0, K % 32 == 0) in the AMX tile order that
    `rows_matmul(bf16_tiled=True)` reads: the same shape and values, each 16 outputs x 32 k as one
    1 KB tile of 16 k-pairs x 16 outputs (element [g, b, i, n, j] = w[16 g + n, 32 b + 2 i + j])."""
    *lead, n, k = w.shape
    if n % 16 or k % 32:
        raise ValueError(f"bf16_tile_order: weights [.., N, K] need N % 16 == 0 and K % 32 == 0, got {n} x {k}")
    tiles = jnp.asarray(w, jnp.bfloat16).reshape(*lead, n // 16, 16, k // 32, 16, 2)
    return jnp.swapaxes(jnp.swapaxes(tiles, -4, -3), -3, -2).reshape(*lead, n, k)


TILED_PATHS = {"auto": 1, "tiles": 2, "emulated": 3}  # `rows_matmul_blocks(tiled_path=)`


def rows_matmul_blocks(x, blocks, layer=None, tiled_path: str = "auto"):
    """`rows_matmul` for weights kept as GGUF blocks (`blocks.BlockWeights`: Q4_1 or Q8_0 codes
    with float32 scales [.., N, K/32]); each tile's weight rows are decoded in cache to the same
    float32 values the checkpoint's dequantization gives, so the products are `rows_matmul`'s
    bits for those float32 weights. A layer stack [L, N, ..] takes a traced `layer`."""
    codes, scale, offset = blocks.codes, blocks.scale, blocks.offset
    if layer is None:
        codes, scale, layer = codes[None], scale[None], 0
        offset = None if offset is None else offset[None]
    bits = 4 if codes.shape[-1] * 2 == x.shape[1] else 8
    if offset is None:
        offset = jnp.zeros((1, 1, 1), jnp.float32)
    call = jax.ffi.ffi_call(BLOCKS_TARGET, jax.ShapeDtypeStruct((x.shape[0], codes.shape[1]), jnp.float32))
    return call(x, codes, scale, offset, jnp.asarray(layer, jnp.int32).reshape(1), bits=np.int32(bits),
                tiled=np.int32(TILED_PATHS[tiled_path] if isinstance(blocks, TiledQ4) else 0))


def greedy_tokens(x, w, head, fast: bool = True):
    """int32 [R]: argmax over v of `rows_matmul(x, w)` [R, V] (the same bits, so the same tokens:
    the first maximum, the first NaN in a row with one), for x float32 [R <= 64, K] and the
    weights w float32 [V, K] with their `greedy_head.GreedyHead` (its int8 tiles). The
    approximation's int32 sums run on AMX tiles (`amx_available()`), else with AVX-512 VNNI
    (`vnni_available()`), else as plain code (slow); `fast` False: as plain code (for tests).
    Call `available()` first."""
    sums = (2 if _amx_allowed() else 1) if fast else 0
    call = jax.ffi.ffi_call(GREEDY_TARGET, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return call(x, w, head.packed, head.scale, head.row_max, head.row_err, sums=np.int32(sums))
