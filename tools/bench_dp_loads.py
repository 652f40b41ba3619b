"""The cost of synchronous loads under DPScheduler, side by side (issue 36).

Until 961f08e, under tpu-inference's DPScheduler a load was synchronous: vLLM scheduled the
request's forward in the same step as its load, so that step's forward on every host waited for the
load's copies (and for a save of the same slot still in flight). Since then loads are asynchronous,
as with one scheduler: the load is issued, the request waits, and the other requests' steps go on.

This tool runs one repeated-prefix workload through tpu-inference's own DPScheduler (the pod-slice
simulation, 2 hosts x 4 CPU devices, DP 2 x TP 4) on two trees in one run, alternating:
``--old`` (default a8f294a, the last tree with synchronous loads under DPScheduler; its slice
worker names a runner field that tree had just removed, so the tool passes an empty dict there: only
the excused-reads count reads it, and no load fails in this workload) checked out in a
temporary git worktree, and this tree. Each run is a child process with its tree first on
``sys.path`` and the same venv, and the same synthetic model (context-dependent, a8f294a). Three
waves: the first computes every prefix, the second loads them (and compiles the load programs), the
third is measured: per tree the median wall time of its steps that loaded chunks and of those that
loaded none, and its wall time, and the ratios old/new. CPU only: what it shows is the scheduling difference, not TPU copy speed.

    python tools/bench_dp_loads.py [--old a8f294a] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child() -> None:
    """One run on the tree first on sys.path; prints one JSON line."""
    import jax

    import tpuoffload
    from tpuoffload.sim.podslice import PodSlice, SliceSpec
    from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

    if jax.default_backend() != "cpu":
        raise SystemExit(f"expected CPU JAX, got {jax.default_backend()}")
    w = PrefixRepetition(num_prefixes=8, prefix_blocks=6, suffix_len=(8, 16), output_len=(8, 16),
                         num_requests=16, waves=3, arrivals_per_step=4, seed=1)
    spec = SliceSpec(num_hosts=2, devices_per_host=4, layout="bf16-dp2-tp4", num_blocks=96, max_num_seqs=16,
                     max_num_batched_tokens=256, step_timeout_s=120.0,
                     extra_config={"cpu_bytes_to_use": 1 << 24, "save_timeout_s": 60.0})
    pod = PodSlice(spec, None, log_dir=tempfile.mkdtemp(prefix="bench-dp-loads-"))
    try:
        steps: list[tuple[int, float, int]] = []  # (wave, seconds, chunks loaded by the step)
        step, reset = pod.step, pod.scheduler.reset_prefix_cache
        wave = [0]

        def timed() -> None:
            before = pod.stats.totals()["chunks_loaded"]
            t0 = time.perf_counter()
            step()
            steps.append((wave[0], time.perf_counter() - t0, pod.stats.totals()["chunks_loaded"] - before))

        def next_wave() -> bool:
            wave[0] += 1
            return reset()

        pod.step, pod.scheduler.reset_prefix_cache = timed, next_wave
        res = run_prefix_repetition(pod, w)
        assert res.wrong_outputs == [] and res.finished == res.requests, res
        assert pod.mismatches == [0, 0], pod.mismatches
        last = [(s, n) for k, s, n in steps if k == w.waves - 1]
        loaded = [s for s, n in last if n]
        plain = [s for s, n in last if not n]
        print(json.dumps({"load_step_s": statistics.median(loaded) if loaded else None,
                          "plain_step_s": statistics.median(plain), "load_steps": len(loaded),
                          "steps": len(last), "wall_s": sum(s for s, _ in last), "per_wave_loaded": res.per_wave_loaded,
                          "hit_tokens": pod.stats.totals()["hit_tokens"], "jax": jax.__version__,
                          "tree": os.path.dirname(os.path.dirname(os.path.abspath(tpuoffload.__file__)))}),
              flush=True)
    finally:
        pod.close()


def run_tree(tree: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, cwd=tree,
                         capture_output=True, text=True, timeout=900, start_new_session=True)
    if out.returncode != 0:
        raise RuntimeError(f"run on {tree} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if os.path.realpath(r["tree"]) != os.path.realpath(tree):
        raise RuntimeError(f"the run meant for {tree} imported tpuoffload from {r['tree']}")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="a8f294a", help="the tree with synchronous loads under DPScheduler")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child()
        return 0
    old = tempfile.mkdtemp(prefix="tpuoffload-old-")
    subprocess.run(["git", "-C", HERE, "worktree", "add", "--detach", old, args.old], check=True,
                   capture_output=True)
    worker = os.path.join(old, "tpuoffload", "sim", "slice_worker.py")
    text = open(worker).read()
    if "runner.stats.step_mismatches" in text:  # see the module doc
        with open(worker, "w") as f:
            f.write(text.replace("runner.stats.step_mismatches", "{}"))
    try:
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for rep in range(args.reps):
            for name, tree in (("old", old), ("new", HERE)):
                r = run_tree(tree)
                runs[name].append(r)
                print(f"rep {rep} {name}: {json.dumps(r)}", flush=True)
        med = {name: {k: statistics.median(r[k] for r in rs) for k in ("load_step_s", "plain_step_s", "wall_s")}
               for name, rs in runs.items()}
        rev = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        print(f"\nplatform: CPU JAX {runs['new'][0]['jax']}, 2 hosts x 4 devices, DP 2 x TP 4 (DPScheduler); "
              f"old = {args.old} (synchronous loads), new = {rev} (asynchronous); medians of {args.reps} runs each")
        print(f"{'':<6}{'step with a load':>18}{'step without':>14}{'third wave':>15}")
        for name in ("old", "new"):
            m = med[name]
            print(f"{name:<6}{m['load_step_s'] * 1e3:>15.1f} ms{m['plain_step_s'] * 1e3:>11.1f} ms{m['wall_s']:>13.1f} s")
        print(f"ratio old/new: step with a load x{med['old']['load_step_s'] / med['new']['load_step_s']:.2f}, "
              f"step without x{med['old']['plain_step_s'] / med['new']['plain_step_s']:.2f}, "
              f"third wave x{med['old']['wall_s'] / med['new']['wall_s']:.2f}")
    finally:
        subprocess.run(["git", "-C", HERE, "worktree", "remove", "--force", old], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
