"""SGLang's out-of-tree platform for this package: `python -m sglang.launch_server` on CPU (and,
with `SGLANG_PLATFORM=dflash_jax`, anywhere) runs its target in JAX and DFLASH with our drafter.

Declared in pyproject.toml as the `sglang.srt.platforms` entry point `dflash_jax` ->
`activate()`. SGLang (`sglang.srt.platforms._resolve_platform`) calls every installed platform
plugin's `activate()` and uses the single one that returns a class name; `SGLANG_PLATFORM=<name>`
selects one explicitly (then `activate()` must not return None). We activate where SGLang itself
has no device to run on: no CUDA / ROCm / XPU / MPS device and no `SGLANG_USE_CPU_ENGINE=1`
(SGLang's own CPU engine, which needs a source-built sgl_kernel). A TPU host has no torch
device either, so it activates there too (JAX then runs on the TPU).

What the platform decides (SGLang's `SRTPlatform` hooks, sglang 0.5.23):
- `supports_speculative_algorithm("DFLASH")`: True. SGLang's `_handle_dflash`
  (arg_groups/speculative_hook.py) refuses DFLASH on any device but CUDA/NPU/XPU otherwise.
- `get_speculative_worker_cls("DFLASH")`: our `DFlashSpecWorker` (the name DFLASH is SGLang's
  own; the platform hook is the only official way to give it another worker).
- `apply_server_args_defaults`: the settings our worker needs (page size 1, no overlap
  schedule, no radix cache, no CUDA graphs) and a clear refusal of what it cannot serve.
- The target worker is not a platform hook: `sglang_plugin.register` swaps SGLang's
  `TpModelWorker` for ours when this platform is the active one (see sglang_target.py).
"""

from __future__ import annotations

import logging
import os

import psutil
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

logger = logging.getLogger(__name__)

PLATFORM_NAME = "dflash_jax"  # the entry point name, what SGLANG_PLATFORM selects
SUPPORTED_ALGORITHMS = ("DFLASH",)


def activate() -> str | None:
    """SGLang's platform-plugin contract: our platform's qualified class name, or None."""
    if os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME:
        return f"{__name__}.DFlashJaxPlatform"
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1" or _torch_has_a_device():
        return None
    return f"{__name__}.DFlashJaxPlatform"


def _torch_has_a_device() -> bool:
    """A device SGLang's own platforms run on (we step aside there unless selected)."""
    import torch

    if torch.cuda.is_available():  # CUDA and ROCm
        return True
    xpu, mps = getattr(torch, "xpu", None), getattr(torch, "mps", None)
    return bool((xpu is not None and xpu.is_available()) or (mps is not None and mps.is_available()))


class DFlashJaxPlatform(SRTPlatform):
    """Torch sees a CPU (SGLang's request bookkeeping tensors live there); compute is JAX's."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    # No Triton on this device: SGLang then uses its torch-native allocator and
    # req_to_token writers (mem_cache/allocation.py::write_cache_indices).
    capabilities = PlatformCapabilities()

    # -- speculative decoding -------------------------------------------------------------
    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return str(algorithm).upper() in SUPPORTED_ALGORITHMS

    def get_speculative_worker_cls(self, algorithm: str) -> type | None:
        if str(algorithm).upper() != "DFLASH":
            raise ValueError(f"the {PLATFORM_NAME} platform serves --speculative-algorithm DFLASH only, got {algorithm}")
        from sgl_dflash.integrations.sglang_dflash import DFlashSpecWorker

        return DFlashSpecWorker

    # The drafter runs in JAX (torchax); SGLang asks for a draft attention backend name anyway.
    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "torch_native"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == "torch_native"

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    # -- server arguments -----------------------------------------------------------------
    def apply_server_args_defaults(self, server_args) -> None:
        """Runs inside SGLang's argument resolution; what it assigns becomes the resolved value.
        Reads the user's values first, so an unsupported explicit choice is refused, not ignored."""
        from sgl_dflash.integrations.sglang_args import apply_platform_defaults

        apply_platform_defaults(server_args)

    # -- device facts SGLang reads ([Active] in sglang's DeviceMixin) -----------------------
    def get_device_total_memory(self, device_id: int = 0) -> int:
        return int(psutil.virtual_memory().total)

    def get_current_memory_usage(self, device=None) -> float:
        vm = psutil.virtual_memory()
        return float(vm.total - vm.available)

    def get_available_memory(self, device_id: int = 0) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def get_device(self, device_id: int = 0):
        import torch

        return torch.device("cpu")

    def set_device(self, device) -> None:
        pass

    def get_device_name(self, device_id: int = 0) -> str:
        return "cpu (JAX target via sgl-dflash)"

    def get_device_capability(self, device_id: int = 0):
        return None

    def get_torch_distributed_backend_str(self) -> str:
        return "gloo"

    def is_pin_memory_available(self, device=None) -> bool:
        return False
