#!/usr/bin/env bash
# The main job, from nothing: set up .venv, then run the CPU demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
exec timeout -k 30 1800 .venv/bin/python -m tpuoffload.demo "$@"
