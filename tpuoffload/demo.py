"""The main job: ``vllm serve`` on tpu-inference's Ray executor over a local 2-node Ray cluster,
measured by ``vllm bench serve`` with and without tpuoffload (tpuoffload.sim.serve_stack).

    python -m tpuoffload.demo [--plan P]                      the serving stack (default)
    python -m tpuoffload.demo --podslice [--hosts 2] ...      a pod slice of our own driver
    python -m tpuoffload.demo --engine [--tp 1 2] ...         vLLM's LLM on tpu-inference's runner

The pod slice (``--podslice``, this module's own options below) serves a prefix_repetition workload
through vLLM's real scheduler and tpuoffload, then prints the per-host stats table.

Wave 1 computes each shared prefix once (and the hosts save it); vLLM's on-device prefix cache is
then reset, as eviction under load would, so wave 2 is served from host RAM on every host.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _progress_bar(total: int, t0: float):
    last = [-1]

    def show(done: int, step: int) -> None:
        if done == last[0]:
            return
        last[0] = done
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests  step {step}  "
                         f"{time.monotonic() - t0:5.1f}s" + ("" if sys.stderr.isatty() else "\n"))
        sys.stderr.flush()
    return show


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--engine" in argv:  # the real engine: vLLM + tpu-inference's worker and runner (tpuoffload.sim.real_engine)
        from tpuoffload.sim.real_engine import demo

        return demo([a for a in argv if a != "--engine"])
    if "--podslice" not in argv:  # the real serving stack: vllm serve on tpu-inference's Ray executor, 2 hosts
        from tpuoffload.sim.serve_stack import demo as serve_demo

        return serve_demo(argv)
    argv = [a for a in argv if a != "--podslice"]
    p = argparse.ArgumentParser(prog="python -m tpuoffload.demo --podslice", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="JAX processes, one per simulated host (default 2)")
    p.add_argument("--devices-per-host", type=int, default=2)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=192, help="tokens per shared prefix")
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cpu-bytes", type=int, default=8 << 20, help="host RAM per host for KV (cpu_bytes_to_use)")
    p.add_argument("--stats-dir", default=None, help="where hosts write snapshots (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default=None,
                   help="a named tpu-inference deployment from tpuoffload.sim.tpu_layouts.LAYOUTS (its devices must "
                        "equal hosts x devices-per-host); default: bf16, 8 KV heads, tensor parallel over every device")
    args = p.parse_args(argv)
    if args.hosts < 1 or args.devices_per_host < 1 or args.prompts < args.prefixes or args.prefixes < 1:
        p.error("need --hosts >= 1, --devices-per-host >= 1 and --prompts >= --prefixes >= 1")

    from tpuoffload.cli import analyse, load_snapshots, render, report
    from tpuoffload.sim.engine import run_waves
    from tpuoffload.sim.podslice import PodSlice, SliceSpec
    from tpuoffload.sim.workload import prefix_repetition

    stats_dir = args.stats_dir or tempfile.mkdtemp(prefix="tpuoffload-stats-")
    interval = 0.5
    spec = SliceSpec(
        num_hosts=args.hosts, devices_per_host=args.devices_per_host, num_blocks=256, block_size=args.block_size,
        num_kv_heads=8, head_dim=128, dtype="bfloat16", layout=args.layout, max_num_seqs=16,
        max_num_batched_tokens=512,
        extra_config={"cpu_bytes_to_use": args.cpu_bytes, "stats_dir": stats_dir, "stats_interval_s": interval},
    )
    layout = spec.slice_layout()
    requests = prefix_repetition(args.prompts, args.prefixes, args.prefix_len, args.suffix_len, args.output_len,
                                 seed=args.seed, block_size=args.block_size)
    print(f"tpuoffload demo: {args.hosts} hosts x {args.devices_per_host} CPU devices; {args.prompts} prompts over "
          f"{args.prefixes} shared prefixes of {args.prefix_len} tokens; stats in {stats_dir}")
    print(f"KV cache: tpu-inference 0.32's own create_kv_caches and runner mesh, layout {layout.name}: "
          f"{layout.num_layers} layers, {layout.num_kv_heads} KV heads, head_dim {layout.head_dim}, {layout.dtype}, "
          f"tensor parallel {layout.tp} x data {layout.dp} x attention-data {layout.attn_dp} x dcp {layout.dcp}")
    t0 = time.monotonic()
    with PodSlice(spec, log_dir=stats_dir) as pod:
        print(f"slice up in {time.monotonic() - t0:.1f}s")
        t0 = time.monotonic()
        wave1, wave2 = requests[:args.prefixes], requests[args.prefixes:]
        show = _progress_bar(len(requests), t0)
        tick = lambda pod: show(len(pod.finished), pod.steps)  # noqa: E731
        run_waves(pod, [wave1, wave2], on_step=tick)
        wall = time.monotonic() - t0
        sys.stderr.write("\n")
        time.sleep(interval)
        pod.step()  # an empty step: every host and the scheduler write a final snapshot
        states = pod.worker_state()
    snaps = load_snapshots([stats_dir])
    analyse(snaps, now=time.time(), stale_after_s=None, inflight_age_s=60, max_step_lag=50)
    rep = report(snaps, time.time())
    print()
    print(render(rep))
    t = rep["total"]
    moved = t["saved_GiB"] + t["loaded_GiB"]
    mismatches = sum(s["mismatches"] for s in states)
    verified = sum(s["positions_verified"] for s in states)
    # The slice stops at the first divergence (DigestMismatch); counted here all the same, so the
    # line below reports what was compared rather than what is expected.
    diverged = sum(1 for per_host in pod.digests if len(set(per_host)) != 1)
    print()
    print(f"requests finished:   {len(pod.finished)}/{len(requests)} in {pod.steps} steps, {wall:.1f}s")
    print(f"host-RAM hit rate:   {t.get('hit_rate', 0.0):.1%} of prompt tokens")
    print(f"bytes moved:         {moved * 1024:.1f} MiB ({t['saved']} chunks saved, {t['loaded']} loaded, all hosts)")
    print(f"throughput:          {moved * 1024 / wall:.1f} MiB/s of KV moved over the run")
    if diverged:
        print(f"dispatch digests:    DIFFER between hosts at {diverged} of {len(pod.digests)} steps")
    else:
        print(f"dispatch digests:    identical on all {args.hosts} hosts at every one of {len(pod.digests)} steps")
    print(f"KV verified:         {verified} context positions checked, {mismatches} mismatches")
    if rep["flagged"]:
        print(f"flagged by the stats check: {', '.join(rep['flagged'])}")
    ok = mismatches == 0 and not diverged and not rep["flagged"] and len(pod.finished) == len(requests)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
