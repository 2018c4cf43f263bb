"""Target model side of sgl-dflash: pure JAX models over a paged KV cache (no torch)."""

from jax_backend import sampling
from jax_backend.batch import Batch, BatchError, BatchLayout, SeqInput, build_batch
from jax_backend.config import CheckpointError, RopeScaling, TargetConfig
from jax_backend.kv_cache import OutOfPages, PageAllocator
from jax_backend.loader import load_target
from jax_backend.outputs import ForwardOutput, SampleOutput, VerifyOutput
from jax_backend.paged_attention import ragged_paged_attention
from jax_backend.runner import ContextLengthError, TargetRunner

__all__ = [
    "Batch",
    "BatchError",
    "BatchLayout",
    "CheckpointError",
    "ContextLengthError",
    "ForwardOutput",
    "OutOfPages",
    "PageAllocator",
    "RopeScaling",
    "SampleOutput",
    "SeqInput",
    "TargetConfig",
    "TargetRunner",
    "VerifyOutput",
    "build_batch",
    "load_target",
    "ragged_paged_attention",
    "sampling",
]
