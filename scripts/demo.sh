#!/usr/bin/env bash
# The main job, from nothing: set up .venv, then run the CPU demo.
#   bash scripts/demo.sh              vllm serve on tpu-inference's Ray executor, 2 local Ray nodes, measured by
#                                     vllm bench serve with and without tpuoffload (docs/real-engine.md)
#   bash scripts/demo.sh --podslice   the pod-slice simulation (our own driver of 2 JAX processes)
#   bash scripts/demo.sh --engine     vLLM's LLM on tpu-inference's worker and runner, one process
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
exec timeout -k 30 1800 .venv/bin/python -m tpuoffload.demo "$@"
