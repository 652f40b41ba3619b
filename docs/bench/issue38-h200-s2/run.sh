#!/bin/bash
# Issue 38, second session: the engine before (86725a7) and after (02f4ba9) this session's save()
# changes, side by side on one H200 in one lease. From a checkout holding both trees:
#   git archive 86725a7 tpuoffload tools | tar -x -C .b38/old    # then the new tools/bench_transfer.py
#   git archive 02f4ba9 tpuoffload tools | tar -x -C .b38/new    # and tools/probe_save_dispatch.py in both
#   bash docs/bench/issue38-h200-s2/run.sh
# Per deployment, the old tree's then the new tree's tools/bench_transfer.py (each its own process,
# the same bench file in both), fresh store (contiguous) and the per-chunk LRU store's churned slots
# (tools/churn_h200.json); then tools/probe_save_dispatch.py --phases on both trees; then a second
# round of benches while the deadline allows. Writes $OUT/log.txt and $OUT/results.tar.
set -o pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; R=/tmp/r38; mkdir -p "$O" "$R"
B=$PWD/.b38
START=$(date +%s); DEADLINE=$((START + ${DEADLINE_S:-560}))
left() { echo $((DEADLINE - $(date +%s))); }
step() {  # step CAP_S TREE CMD...: run CMD in tree TREE under min(CAP_S, time left - 5), or skip it
  local cap=$1 tree=$2; shift 2; local t=$(( $(left) - 5 )); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then echo "SKIPPED (deadline): $tree $*"; return; fi
  echo "=== $(date -u +%T) (+$(( $(date +%s) - START ))s, cap ${t}s) [$tree]: $*"
  (cd "$B/$tree" && timeout "$t" "$@"); echo "=== rc=$?"
}
bench() {  # bench RUN TREE DEPLOYMENT
  step 120 $2 python3 tools/bench_transfer.py --expect-platform gpu --deployments $3 --sizes-mib 64 512 \
    --no-per-block --churn-file lru=tools/churn_h200.json --json "$R/run$1_$2_$3.json"
  tar -cf "$O/results.tar" -C "$R" .
}
DEPS="gpt-oss-120b-tp8 qwen3-coder-480b-fp8-tp16 llama-70b-tp8 deepseek-v3-mla-fp8"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import jax, jaxlib, numpy, numba; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'numpy', numpy.__version__, 'numba', numba.__version__, jax.devices())"
  (cd $B/new && python3 -c "from tpuoffload.worker.copy_plan import save_plan; print(save_plan([5, 1, 2, 3], 0.5, 8))")  # compiles the planner once (cached)
  for d in $DEPS; do bench 1 old $d; bench 1 new $d; done
  for t in old new; do
    step 90 $t python3 tools/probe_save_dispatch.py --expect-platform gpu --deployments $DEPS --sizes-mib 64 512 \
      --churn-file tools/churn_h200.json --iters 15 --phases --json "$R/probe_$t.json"
  done
  tar -cf "$O/results.tar" -C "$R" .
  for d in $DEPS; do bench 2 new $d; bench 2 old $d; done
} 2>&1 | tee "$O/log.txt"
