#!/bin/bash
# Issue 38 device measurement: one call on one H200 (JAX preinstalled), from a tree holding
# tpuoffload/ and tools/ (the committed tree: `git archive HEAD tpuoffload tools | tar -x -C .b38`):
#   cd .b38 && bash ../docs/bench/issue38-h200/run.sh
# Two runs of tools/bench_transfer.py per deployment, each deployment in its own process, the old
# store's churned slots (lru: tools/churn_h200.json, per-chunk LRU) and the new one's (extents:
# tools/churn_h200_extents.json) side by side with a fresh store's (contiguous) in one process;
# then the DP store-write probe. Writes $OUT/log.txt and $OUT/results.tar (the JSONs).
set -o pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r38; mkdir -p "$O" "$R"
START=$(date +%s); DEADLINE=$((START + ${DEADLINE_S:-570}))
left() { echo $((DEADLINE - $(date +%s))); }
step() {  # step CAP_S CMD...: run CMD under min(CAP_S, time left - 5), or skip it
  local cap=$1; shift; local t=$(( $(left) - 5 )); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 15 ]; then echo "SKIPPED (deadline): $*"; return; fi
  echo "=== $(date -u +%T) (+$(( $(date +%s) - START ))s, cap ${t}s): $*"
  timeout "$t" "$@"; echo "=== rc=$?"
}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax, jaxlib, numpy; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'numpy', numpy.__version__, jax.devices())"
  for run in ${RUNS:-1 2}; do
    for d in ${DEPLOYMENTS:-gpt-oss-120b-tp8 qwen3-coder-480b-fp8-tp16 llama-70b-tp8 deepseek-v3-mla-fp8}; do
      step 150 python3 tools/bench_transfer.py --expect-platform gpu --deployments $d --sizes-mib 64 512 \
        --no-per-block --churn-file lru=tools/churn_h200.json extents=tools/churn_h200_extents.json \
        --json "$R/run${run}_$d.json"
      tar -cf "$O/results.tar" -C "$R" .
    done
  done
  step 90 python3 tools/probe_dp_store_write.py --expect-platform gpu --rounds 5
} 2>&1 | tee "$O/log.txt"
