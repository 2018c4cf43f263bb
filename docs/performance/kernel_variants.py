"""Kernel variants for the A/B scripts beside it: one CPU kernel source compiled once per variant,
each with its own -D flags and its FFI handler renamed, so that all of them load into one process
and run interleaved on the same inputs.

    variants = parse(sys.argv[1:])  # "label:flag;flag" -> [(label, [flags])]
    names = build("rows_matmul.cc", "sgl_dflash_rows_matmul", [flags for _, flags in variants])
    matmul = calling("MATMUL_TARGET", names[0], cpu_kernels.rows_matmul)  # a jittable function
"""
import ctypes
import subprocess
import tempfile
from pathlib import Path

import jax
from jax_backend import cpu_kernels

SOURCES = Path(cpu_kernels.__file__).parent


def parse(args: list[str]) -> list[tuple[str, list[str]]]:
    """Command-line variants "label:flags", flags separated by ";" (none: the source as it is)."""
    variants = [arg.split(":", 1) for arg in args]
    return [(label, [f for f in flags.split(";") if f]) for label, flags in variants]


def build(source: str, handler: str, flag_lists: list[list[str]]) -> list[str]:
    """Compiles `source` (a file of jax_backend/cpu_kernels) once per flag list, with `handler`
    renamed per build, and registers each; returns the handlers' names."""
    tmp = Path(tempfile.mkdtemp())
    (tmp / "common.h").write_text((SOURCES / "common.h").read_text())
    text, names = (SOURCES / source).read_text(), []
    for i, flags in enumerate(flag_lists):
        name = f"{handler}_variant_{i}"
        (tmp / f"{name}.cc").write_text(text.replace(handler, name))
        subprocess.run(["g++", *cpu_kernels.FLAGS, "-w", *flags, "-I", jax.ffi.include_dir(), str(tmp / f"{name}.cc"),
                        "-o", str(tmp / f"{name}.so")], check=True)
        lib = ctypes.CDLL(str(tmp / f"{name}.so"))
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
        names.append(name)
    return names


def calling(attribute: str, name: str, fn):
    """`fn` with `cpu_kernels.<attribute>` (the handler it calls) set to `name` while it traces."""
    def wrapped(*args):
        default = getattr(cpu_kernels, attribute)
        setattr(cpu_kernels, attribute, name)
        try:
            return fn(*args)
        finally:
            setattr(cpu_kernels, attribute, default)
    return wrapped
