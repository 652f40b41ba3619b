#!/usr/bin/env bash
# Creates .venv with everything tpuoffload and its tests need (CPU JAX, vLLM on a CPU torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import tpuoffload, vllm, jax, orbax.checkpoint, pytest" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # torch first, pinned: vLLM 0.32's pin, whose CPU build is what this machine offers.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q "vllm==0.32.0" -e ".[test]"
  # CUDA builds of these break `import vllm` on a CPU torch; tpuoffload needs none of them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
