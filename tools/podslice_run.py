#!/usr/bin/env python
"""Run vLLM's prefix_repetition workload (scaled down) on a simulated pod slice and report.

    python tools/podslice_run.py --hosts 4 --devices-per-host 2 --requests 32 --chaos --seed 1
    python tools/podslice_run.py --hosts 4 --devices-per-host 4 --layout qwen3-coder-480b-fp8-tp16 --chaos

N JAX processes on this machine (jax.distributed over gloo, CPU devices), each holding its own KV
heads of the cache tpu-inference allocates (a tensor-parallel model over all devices, or a named
deployment of tpuoffload.sim.tpu_layouts.LAYOUTS), driven by vLLM's real Scheduler through
tpuoffload. For many seeded chaos runs and one summary table, use tools/soak.py. Every step the harness compares the
hosts' dispatch digests and sampled tokens; the synthetic runner verifies every context position
it reads; every generated token is checked. Exit status 0 only if everything held.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def per_source(stats) -> dict[str, Counter]:
    """OffloadStats keys are "<source>|<seq>|<name>": totals per source (host id or "sched")."""
    out: dict[str, Counter] = {}
    for key, value in stats.data.items():
        source, _, name = key.split("|", 2)
        out.setdefault(source, Counter())[name] += value
    return out


def chaos_for(args):
    from tpuoffload.sim.chaos import Chaos

    if not args.chaos:
        return Chaos(seed=args.seed)
    return Chaos.storm(args.hosts, seed=args.seed)


def run_once(args, seed: int, run_no: int) -> tuple[bool, dict]:
    from tpuoffload.sim.podslice import DigestMismatch, PodSlice, SliceError, SliceSpec
    from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

    args.seed = seed
    # The default pool is per DP rank (DPScheduler splits the blocks over its ranks): the chaos pool
    # is small enough for preemptions on every rank, never so small that a rank schedules nothing.
    ranks = 1
    if args.layout is not None:
        from tpuoffload.sim.tpu_layouts import LAYOUTS

        ranks = LAYOUTS[args.layout].dp * LAYOUTS[args.layout].attn_dp
    num_blocks = args.num_blocks or (28 if args.chaos else 48) * ranks
    extra = {"cpu_bytes_to_use": args.cpu_bytes, "save_timeout_s": 3.0, "load_wait_timeout_s": 2.0}
    work_dir = tempfile.mkdtemp(prefix="podslice-run-")
    if args.disk_bytes:
        extra.update(disk_path=os.path.join(work_dir, "disk-{host}"), disk_bytes_to_use=args.disk_bytes)
    if args.restart:
        extra.update(persist_path=os.path.join(work_dir, "ckpt"))
    spec = SliceSpec(num_hosts=args.hosts, devices_per_host=args.devices_per_host, num_kv_heads=args.kv_heads,
                     layout=args.layout, num_blocks=num_blocks, max_num_seqs=16, max_num_batched_tokens=256,
                     extra_config=extra)
    workload = PrefixRepetition(num_prefixes=args.prefixes, prefix_blocks=args.prefix_blocks,
                                num_requests=args.requests, waves=args.waves, seed=seed)
    chaos = chaos_for(args)
    print(f"run {run_no}/{args.runs} (seed {seed}): {args.hosts} hosts x {args.devices_per_host} CPU devices, "
          f"cache {spec.slice_layout().name}, GPU pool {num_blocks} blocks, chaos {'on' if args.chaos else 'off'}")
    t_start = time.monotonic()
    summary = {"steps": 0, "requests": 0, "saved": 0, "loaded": 0, "mismatches": 0, "wall": 0.0}
    pod = None
    first_hit: list[float] = []

    def note_first_hit(p) -> None:
        if not first_hit and p.stats.totals()["hit_tokens"]:
            first_hit.append(time.monotonic())

    try:
        if args.restart:  # a first slice fills host RAM, checkpoints at its clean shutdown, goes away
            with PodSlice(spec, chaos, log_dir=args.log_dir) as first:
                run_prefix_repetition(first, workload)
                t_stop = time.monotonic()
                per_host = first.shutdown()
                print(f"  first slice       {first.steps} steps; shutdown checkpoint {time.monotonic() - t_stop:.1f}s: "
                      f"{sum(h.get('persist_saved_chunks', 0) for h in per_host)} chunks, "
                      f"{sum(h.get('persist_saved_bytes', 0) for h in per_host) / 2**20:.1f} MiB")
            t_start = time.monotonic()
        with PodSlice(spec, chaos, log_dir=args.log_dir) as pod:
            up = time.monotonic() - t_start
            res = run_prefix_repetition(pod, workload, on_step=note_first_hit)
            states = pod.worker_state()
            leaks = {f"{r.get('source', 'scheduler')}:{k}": v for r in pod.leak_reports() for k, v in r.items()
                     if v and k != "source"}
    except DigestMismatch as e:
        print(f"  digest check      FAILED: {str(e).splitlines()[0]}")
        print("\n".join("    " + line for line in str(e).splitlines()[1:40]))
        return False, summary
    except SliceError as e:
        print(f"  slice             FAILED: {str(e).splitlines()[0]}")
        print("\n".join("    " + line for line in str(e).splitlines()[1:40]))
        return False, summary
    totals = pod.stats.totals()
    hosts = per_source(pod.stats)
    saved = [hosts.get(str(h), Counter())["chunks_saved"] for h in range(args.hosts)]
    loaded = [hosts.get(str(h), Counter())["chunks_loaded"] for h in range(args.hosts)]
    mismatches = [s["mismatches"] for s in states]
    verified = sum(s["positions_verified"] for s in states)
    leaked = leaks or {f"host{s['host']}": s for s in states
                       if s["inflight_chunks"] or s["staging_bytes"] or
                       s["backend_bytes"] != pod.start_state[s["host"]]["backend_bytes"]}
    digests_ok = len(pod.digests) == pod.steps and all(len(set(d)) == 1 for d in pod.digests)
    hit_rate = totals["hit_tokens"] / totals["lookup_tokens"] if totals["lookup_tokens"] else 0.0
    print(f"  slice up          {up:.1f}s; logs in {pod.log_dir}")
    print(f"  steps             {res.steps} ({pod.preemptions} preemptions)")
    print(f"  requests          {res.requests} in {res.waves} waves (finished {res.finished}, aborted {res.aborted}, "
          f"wrong outputs {len(res.wrong_outputs)})")
    print(f"  chunks saved      {sum(saved)} on all hosts, per host {saved}; save failures {totals['save_failures']}")
    print(f"  chunks loaded     {sum(loaded)} on all hosts, per host {loaded}; per wave {res.per_wave_loaded}; "
          f"load errors {totals['load_errors']}")
    if pod.dp_ranks > 1:
        print(f"  cross-rank        {totals['cross_rank_chunks_loaded']} chunks loaded from another DP rank's slots "
              f"({totals['cross_rank_hit_tokens']} tokens); {totals['cross_rank_load_errors']} of their rows failed on "
              f"some host (its slot no longer held the chunk there: reused by its owner, or lost; a write still late)")
    print(f"  hit rate          {hit_rate:.1%} of prompt tokens from host RAM "
          f"({totals['hit_tokens']}/{totals['lookup_tokens']})")
    if args.restart:
        print(f"  warm restart      {totals['persist_restored_chunks']} chunks restored on all hosts, "
              f"{totals['restored_ready']} loadable; start to first host-RAM hit "
              f"{first_hit[0] - t_start if first_hit else float('nan'):.1f}s (slice up {up:.1f}s)")
    if args.disk_bytes:
        print(f"  disk tier         spilled {totals['spills_confirmed']} (dropped {totals['spills_dropped']}), "
              f"fetched {totals['fetches_issued']} (failed {totals['fetches_failed']}); chunk files written "
              f"{totals['disk_written_chunks']}, read {totals['disk_read_chunks']}, failed "
              f"{totals['disk_write_failed']} writes / {totals['disk_read_failed']} reads on all hosts")
    print(f"  reports           expired {totals['ledger_expired']}, late {totals['ledger_late']}, "
          f"duplicate {totals['ledger_duplicate']}")
    print(f"  wall time         {res.wall_s:.1f}s workload, {time.monotonic() - t_start:.1f}s with start-up")
    # Every wrong read counts (loads are asynchronous: no forward reads a block whose load failed), and
    # the model's writes and tokens depend on what it read, so a wrong read also shows downstream.
    print(f"  mismatches        {sum(mismatches)} (per host {mismatches}; {verified} context positions verified, "
          f"{sum(s['poisoned_steps'] for s in states)} request steps computed from a wrong read)")
    print(f"  leaks             {leaked or 'none'}")
    print(f"  digest check      {'identical' if digests_ok else 'DIFFERENT'} on all {args.hosts} hosts at every one "
          f"of {len(pod.digests)} steps")
    ok = (digests_ok and not sum(mismatches) and not res.wrong_outputs and not leaked
          and res.finished + res.aborted == res.requests)
    summary.update(steps=res.steps, requests=res.requests, saved=sum(saved), loaded=sum(loaded),
                   mismatches=sum(mismatches), wall=res.wall_s, hit=totals["hit_tokens"],
                   lookup=totals["lookup_tokens"])
    return ok, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="JAX processes, one per simulated host")
    p.add_argument("--devices-per-host", type=int, default=1)
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the cache, split over all devices")
    p.add_argument("--layout", default=None, help="a named tpu-inference deployment from tpuoffload.sim.tpu_layouts."
                   "LAYOUTS instead (its device count must be --hosts x --devices-per-host)")
    p.add_argument("--requests", type=int, default=32, help="requests per wave")
    p.add_argument("--waves", type=int, default=2, help="waves, with reset_prefix_cache() between them")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-blocks", type=int, default=12)
    p.add_argument("--num-blocks", type=int, default=0,
                   help="GPU block pool (default 48 per DP rank, 28 per rank with --chaos)")
    p.add_argument("--cpu-bytes", type=int, default=1 << 22, help="host RAM per host (cpu_bytes_to_use)")
    p.add_argument("--chaos", action="store_true", help="slow/failing hosts, lost slots, dropped and doubled "
                   "reports, aborts, a tiny block pool")
    p.add_argument("--disk-bytes", type=int, default=0, help="disk tier per host (disk_bytes_to_use; 0: off)")
    p.add_argument("--restart", action="store_true", help="warm restart: a first slice runs the workload and "
                   "checkpoints at shutdown; the measured slice restores it and runs the workload again")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=1, help="repeat with seeds seed, seed+1, ...")
    p.add_argument("--log-dir", default=None, help="per-host logs (default: a temp dir)")
    args = p.parse_args(argv)
    if args.layout is not None:
        from tpuoffload.sim.tpu_layouts import LAYOUTS

        if args.layout not in LAYOUTS:
            p.error(f"--layout must be one of {', '.join(sorted(LAYOUTS))}")
        if LAYOUTS[args.layout].num_devices != args.hosts * args.devices_per_host:
            p.error(f"--layout {args.layout} needs {LAYOUTS[args.layout].num_devices} devices: "
                    f"--hosts x --devices-per-host is {args.hosts * args.devices_per_host}")

    t0 = time.monotonic()
    results = []
    first_seed = args.seed
    for i in range(args.runs):
        results.append(run_once(args, first_seed + i, i + 1))
    good = sum(ok for ok, _ in results)
    s = Counter()
    for _, r in results:
        s.update({k: v for k, v in r.items() if isinstance(v, (int, float))})
    print(f"runs {args.runs}: {good} passed, {args.runs - good} failed; steps {s['steps']}, requests {s['requests']}, "
          f"chunks saved {s['saved']}, loaded {s['loaded']}, hit rate "
          f"{(s['hit'] / s['lookup'] if s['lookup'] else 0):.1%}, mismatches {s['mismatches']}, "
          f"wall {time.monotonic() - t0:.1f}s")
    sys.stdout.flush()
    return 0 if good == args.runs else 1


if __name__ == "__main__":
    code = main()
    os._exit(code)  # skip the interpreter's slow teardown of torch/vLLM; the workers are already gone
