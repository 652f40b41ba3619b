#!/bin/bash
# Issue 24 closing measurement: one device call (H200/H100, JAX preinstalled), from the repository root:
#   bash docs/bench/issue24-h200/closing/run.sh
# Writes $OUT/<deployment>.json (tools/bench_transfer.py), $OUT/probes.tar (tools/probe_copies.py
# JSONs) and $OUT/log.txt. Every step runs in its own process under one deadline (DEADLINE_S).
set -o pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; P=/tmp/probes; mkdir -p "$O" "$P"
START=$(date +%s); DEADLINE=$((START + ${DEADLINE_S:-530}))
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
  for d in gpt-oss-120b-tp8 qwen3-coder-480b-fp8-tp16 llama-70b-tp8 deepseek-v3-mla-fp8; do
    step 150 python3 tools/bench_transfer.py --expect-platform gpu --deployments $d --sizes-mib 64 512 \
      --no-per-block --churn-file tools/churn_h200.json --json "$O/$d.json"
  done
  probe() {  # probe NAME DEPLOYMENT MIB WIDTHS... [-- extra flags]
    local name=$1 dep=$2 mib=$3; shift 3
    step 75 python3 tools/probe_copies.py --deployment $dep --size-mib $mib --iters 15 --json "$P/$name.json" --widths "$@"
    tar -cf "$O/probes.tar" -C "$P" .
  }
  probe gpt_64 gpt-oss-120b-tp8 64 256 8 1 --save-path --load-phases tools/churn_h200.json
  probe qwen_64 qwen3-coder-480b-fp8-tp16 64 128 8 1 --save-path --load-phases tools/churn_h200.json
  probe llama_64 llama-70b-tp8 64 32 1 --save-path --load-phases tools/churn_h200.json
  probe ds_64 deepseek-v3-mla-fp8 64 16 1 --save-path --load-phases tools/churn_h200.json
  probe gpt_512 gpt-oss-120b-tp8 512 2048 4 1
  probe qwen_512 qwen3-coder-480b-fp8-tp16 512 1024 4 1
  probe llama_512 llama-70b-tp8 512 256 1
  probe ds_512 deepseek-v3-mla-fp8 512 128 1
  echo "done at +$(( $(date +%s) - START ))s"
} 2>&1 | tee "$O/log.txt"
