#!/usr/bin/env bash
# Qwen3-Coder-480B on a multi-host TPU slice (TP 16), the deployment of tpu-inference PR #2983,
# with tpuoffload instead of tpu-inference's own connector. Run the same command on every host.
# 100 GiB of host RAM per host hold that host's heads of the offloaded KV; each host writes
# /tmp/tpuoffload-stats/host-<id>.json (read them with `tpuoffload stats /tmp/tpuoffload-stats`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec python3 -m vllm.entrypoints.openai.api_server \
  --host=0.0.0.0 --port=8000 \
  --model=Qwen/Qwen3-Coder-480B-A35B-Instruct \
  --served-model-name=Qwen/Qwen3-Coder-480B-A35B-Instruct \
  --tensor-parallel-size=16 --data-parallel-size=1 --enable-expert-parallel \
  --max-model-len=102400 --max-num-batched-tokens=16384 --max-num-seqs=512 \
  --load-format=runai_streamer --kv-cache-dtype=fp8 --gpu-memory-utilization=0.8 \
  --enable-prefix-caching --async-scheduling \
  --kv-transfer-config="$(cat "$here/qwen3-coder-480b-multihost.json")"
