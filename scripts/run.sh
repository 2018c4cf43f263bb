#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: DFLASH vs autoregressive on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m sgl_dflash.demo "$@"
