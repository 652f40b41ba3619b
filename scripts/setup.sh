#!/usr/bin/env bash
# Creates .venv with everything tpuoffload and its tests need (CPU JAX, vLLM on a CPU torch, and
# the parts of tpu-inference whose KV cache layouts and meshes the tests run).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import tpuoffload, vllm, jax, numba, orbax.checkpoint, pytest, flax, importlib.util as u; assert u.find_spec('tpu_inference') and u.find_spec('torchax')" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # torch first, pinned: vLLM 0.32's pin, whose CPU build is what this machine offers.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q "vllm==0.32.0" -e ".[test]"
  # CUDA builds of these break `import vllm` on a CPU torch; tpuoffload needs none of them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # tpu-inference 0.32.0 (the runtime that hosts the connector) without its TPU dependency pins
  # (jax 0.11.2 / libtpu): the tests run its own layout, sharding and mesh code on CPU JAX. Those
  # modules need flax and torchax's ops/mappings (torchax's package __init__ fails on torch 2.13;
  # tpuoffload.sim.tpu_layouts enters the package without it).
  .venv/bin/pip install -q "flax==0.12.8"
  .venv/bin/pip install -q --no-deps "tpu-inference==0.32.0" "torchax==0.0.13"
fi
# The real-engine test and demo (tests/test_real_engine.py, tpuoffload.sim.real_engine) import
# tpu-inference's runner and models, which need qwix and tokamax (and their pure-Python
# dependencies). Exact versions, --no-deps, so jax/torch/vllm stay as they are; tokamax 0.0.12 is the
# newest on the registry (tpu-inference pins 0.0.17.dev; tpuoffload/sim/engine_shims.py stubs the one
# module 0.0.12 lacks).
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('qwix', 'tokamax', 'einshape', 'jaxtyping', 'wadler_lindig', 'typeguard', 'immutabledict', 'tensorboardX')))" 2>/dev/null; then
  .venv/bin/pip install -q --no-deps "qwix==0.1.2" "tokamax==0.0.12" "einshape==1.0" "jaxtyping==0.3.11" \
    "wadler_lindig==0.1.8" "typeguard==2.13.3" "immutabledict==4.3.1" "tensorboardX==2.6.5"
fi
# The test command runs the suite on both cores (pytest-xdist, a test file per worker).
if ! .venv/bin/python -c "import xdist" 2>/dev/null; then
  .venv/bin/pip install -q "pytest-xdist==3.8.0"
fi
# The shared KV tier (issue 37): the `redis` client for its Valkey/Redis backend, and Debian's
# redis-server, which its tests start on a free port. No silent fallback: without apt the install
# fails loudly, naming what to install.
if ! .venv/bin/python -c "import redis" 2>/dev/null; then
  .venv/bin/pip install -q "redis==8.1.0"
fi
if ! command -v redis-server >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: redis-server is missing and apt-get is not available: install Debian's redis-server (or valkey-server as redis-server) and rerun" >&2
    exit 1
  fi
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
  command -v redis-server >/dev/null 2>&1 || { echo "setup.sh: installing redis-server failed" >&2; exit 1; }
fi
# The real serving stack on CPU (tpuoffload/sim/serve_stack.py, tests/test_serve_stack.py): tpu-inference's
# Ray executors (and vLLM's, which they extend) import ray; vLLM 0.32's wheel here declares no ray pin, its
# ray executor needs the compiled-graph extra only for NCCL channels. 2.58.0 is the registry's release.
if ! .venv/bin/python -c "import ray, sys; sys.exit(ray.__version__ != '2.58.0')" 2>/dev/null; then
  .venv/bin/pip install -q "ray==2.58.0"
fi
