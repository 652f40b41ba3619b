#!/bin/bash
# Issue 38, second session: the engine's bench and the DP store-write probe on two H200s of one host
# (nvidia-h200-x2), from the tree of 02f4ba9 in .b38/new (see run.sh):
#   bash docs/bench/issue38-h200-s2/run_x2.sh
# tools/bench_transfer.py --devices 2: tensor parallelism over both devices, each holding the
# deployment's per-device share, every path (raw, floor, engine) moving both shares; bytes verified.
set -o pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r38x2; mkdir -p "$O" "$R"
B=$PWD/.b38/new
START=$(date +%s); DEADLINE=$((START + ${DEADLINE_S:-330}))
step() {  # step CAP_S CMD...: run CMD under min(CAP_S, time left - 5), or skip it
  local cap=$1; shift; local t=$(( DEADLINE - $(date +%s) - 5 )); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then echo "SKIPPED (deadline): $*"; return; fi
  echo "=== $(date -u +%T) (+$(( $(date +%s) - START ))s, cap ${t}s): $*"
  (cd "$B" && timeout "$t" "$@"); echo "=== rc=$?"
}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax, numba; print('jax', jax.__version__, 'numba', numba.__version__, jax.devices())"
  step 60 python3 tools/probe_dp_store_write.py --expect-platform gpu --rounds 5
  for d in gpt-oss-120b-tp8 qwen3-coder-480b-fp8-tp16 llama-70b-tp8 deepseek-v3-mla-fp8; do
    step 100 python3 tools/bench_transfer.py --expect-platform gpu --devices 2 --deployments $d --sizes-mib 64 512 \
      --no-per-block --churn-file lru=tools/churn_h200.json --json "$R/x2_$d.json"
    tar -cf "$O/results_x2.tar" -C "$R" .
  done
} 2>&1 | tee "$O/log_x2.txt"
