#!/usr/bin/env python
"""Seeded chaos runs back to back, on a pod slice, and one table at the end.

    python tools/soak.py --mode fast --hosts 2 --runs 1000            # in-process slice (InProcSlice)
    python tools/soak.py --mode podslice --hosts 4 --runs 30          # N worker processes (PodSlice)
    python tools/soak.py --mode fast --hosts 2 --seed 1017 --runs 1   # replay one run
    python tools/soak.py --mode podslice --hosts 2 --hybrid gpt-oss-like --runs 5  # a hybrid model
    python tools/soak.py --mode fast --dp any --runs 1000             # tpu-inference's DPScheduler

Every run is a pure function of its seed (and --mode, --hosts, --broken): the seed picks the
cache (tpu-inference's layout for 1, 2 or 4 KV heads per host, bf16, fp8 or int8, 1 or 2 devices
per host in fast mode), the workload (1 to 3 waves over a few shared prefixes with vLLM's prefix
cache reset between waves, n > 1 siblings, staggered arrivals), the engine settings (a tiny GPU
block pool for preemption storms, a small host RAM for eviction, a small staging budget, lazy or
eager offload) and the chaos: random write and step delays, a persistently slow host, failed
device-to-host copies, lost slots, dropped and duplicated worker reports, aborts, exceptions at the
worker's fault points, and vLLM's resets between steps
(``scheduler.reset_prefix_cache(reset_running_requests=..., reset_connector=...)``). Timing still
varies between replays (background save threads): ``--repeat N`` runs a seed N times.

With ``--dp`` the slice is a data-parallel layout of 8 devices (DP 2 x TP 4 or attention DP 4 x
TP 2, ``any``: the seed picks; 2 hosts x 4 devices in pod-slice mode, one host in fast mode), scheduled by tpu-inference's own ``DPScheduler`` (one vLLM
scheduler and one tpuoffload scheduler half per rank, in forked processes), with a block pool that
keeps every rank busy (and host RAM above the rows each device keeps spare per batch shard),
chaos that also aborts requests right after their load failed, and in half the runs each rank's
disk tier below its host RAM. Some runs restart warm (``persist_path`` under the run's log dir,
some with periodic checkpoints as well): before a later wave the slice is shut down cleanly (every
host checkpoints every rank's slots), a new one starts on the same directories, empty steps let
every rank adopt what the hosts restored (on one host every restored chunk must be answered), and
the later waves load restored chunks; the chaos goes on. Some runs put the shared tier (a
redis-server the child process starts, emptied before each run, killed with the child) below host
RAM, half of them with a cold new slice (no checkpoint) before a later wave, which finds the
earlier prefixes only in the store. A restarted run's requests, wrong reads, faults and counters
are those of both slices: every request's output is checked whichever slice served it.

The synthetic model's written KV and sampled tokens depend on every context position it read
(tpuoffload/sim/runner.py), so a wrong read anywhere taints everything computed after it. A run
fails when the hosts' dispatch digests or sampled tokens diverge (digest), a context
position or a generated token is wrong (mismatch), it stops making progress or runs past its
deadline (hang: the run is killed), anything is held after it settled (leak: the scheduler half's
``leak_report()``, each host's in-flight saves and staging bytes and, where the host reports it,
its ``idle_report()``; vLLM's requests and block pool; also before a restart, when the last wave
settled), or anything else raises (error).

What a restart under chaos excuses: chunks whose saves failed or were revoked by a connector
reset before the shutdown are not restored; a checkpoint some host failed to write is not
restored (an older complete one is, or none: a cold start); a restored chunk whose hash another
restored slot of its rank also holds is dropped (a save the scheduler had expired stays committed
on the host beside a later copy); restored loads may fail (lost slots: recomputed). Never
excused: a restored chunk read with other bytes (a wrong context position or output), a request
lost between the slices, or, on one host, a restored chunk the ranks never answered.

Runs execute in a child process (``--child``, one per batch of runs, so imports and JAX compiles
are paid once; the JAX persistent compilation cache is shared by every child and pod-slice worker).
The parent holds the per-run deadline: a run that passes it has its child's process group killed
and counts as a hang, and the next runs continue in a fresh child. The child and the pod-slice
workers exit by themselves when their parent disappears.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# Bump when make_scenario draws differently: a seed names a run only together with this version.
# 2: preemption storms under --dp. 3: under --dp, warm restart (persist_path; the slice shut down and
# started again between two waves) and the shared tier (a redis-server below host RAM), each from its
# own generator: every draw of version 2 stays what it was.
SCENARIO_VERSION = 3
FAILURE_KINDS = ("digest", "mismatch", "hang", "leak", "error", "crash")
RESET_KINDS = ("plain", "running", "connector", "running+connector")
# Under DPScheduler, vLLM refuses reset_running_requests while a load is in flight (its "not
# supported yet", as with one scheduler), and tpu-inference 0.32's DPScheduler then leaves the other
# ranks' replies unread in their pipes (DPScheduler.reset_prefix_cache stops at the first rank that
# raised): the engine cannot go on. Those resets are a documented limit there (README), not drawn.
DP_RESET_KINDS = ("plain", "connector")
DEFAULT_RUN_TIMEOUT = {"fast": 60.0, "podslice": 240.0}
DP_RUN_TIMEOUT = 300.0  # DPScheduler forks a process per rank and each compiles its own step programs


# ================================================================ scenarios (pure functions of the seed)
@dataclass
class Scenario:
    """Everything one run does, drawn from its seed."""

    seed: int
    mode: str
    hosts: int
    devices_per_host: int
    num_kv_heads: int
    dtype: str
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    extra_config: dict[str, Any]
    chaos: dict[str, Any]  # tpuoffload.sim.podslice.Chaos fields
    point_faults: dict[str, Any] | None  # tpuoffload.sim.podslice.PointFaults fields
    reset_rate: float  # per step
    requests: list[dict[str, Any]]  # {"req_id", "prompt", "max_tokens", "wave", "arrival_step"}
    settle_between_waves: bool = True
    stall: tuple[int, int] | None = None  # negative control (fast mode): (host, step) that never answers
    # A hybrid model (tpuoffload.sim.hybrid_layouts.HYBRID_LAYOUTS, vLLM's hybrid KV cache manager on):
    # its own heads and dtype; num_blocks is vLLM's block count for the KV memory given.
    hybrid: str | None = None
    # A data-parallel layout of tpuoffload.sim.tpu_layouts.LAYOUTS, scheduled by DPScheduler.
    dp_layout: str | None = None
    # Warm restart (persist_path under the run's log dir): before this wave the slice is shut down
    # cleanly (every host writes its checkpoint) and a new one starts on the same directories.
    # ``restart_cold``: no persist_path (the shared tier's runs): the new slice starts empty, as
    # another replica of the deployment would, and finds earlier prefixes only in the shared store.
    restart_before_wave: int | None = None
    restart_cold: bool = False
    # The shared tier below host RAM: a redis-server of the run's child process (run_scenario).
    shared: bool = False

    def knobs(self) -> str:
        """A one-line description of what this run turned on."""
        on = [k for k, v in self.chaos.items() if v not in (0, 0.0, None, "") and k != "seed"]
        if self.point_faults:
            on.append(f"point_faults(host {self.point_faults['host']}: {','.join(self.point_faults['points'])})")
        if self.reset_rate:
            on.append(f"resets({self.reset_rate:.2f}/step)")
        if self.stall:
            on.append(f"stall(host {self.stall[0]} at step {self.stall[1]})")
        cache = self.hybrid or self.dp_layout or f"{self.num_kv_heads} KV heads {self.dtype}"
        tiers = [name for name, on in (("a disk tier", self.extra_config.get("disk_bytes_to_use")),
                                       ("the shared tier (redis)", self.shared)) if on]
        restart = ""
        if self.restart_cold:
            restart = f", a cold new slice (no checkpoint) before wave {self.restart_before_wave}"
        elif self.restart_before_wave is not None:
            every = self.extra_config.get("persist_interval_s")
            restart = (f", warm restart before wave {self.restart_before_wave}"
                       f"{f' (checkpoints every {every} s)' if every else ''}")
        return (f"{len(self.requests)} requests in {len({r['wave'] for r in self.requests})} waves, "
                f"{cache} on {self.hosts}x{self.devices_per_host} devices, "
                f"{self.num_blocks} GPU blocks, "
                f"{self.extra_config.get('num_cpu_chunks', 'plenty of')} host slots"
                f"{''.join(' and ' + t for t in tiers)}{restart}, "
                f"{'lazy' if self.extra_config.get('lazy_offload') else 'eager'}; chaos: {', '.join(on) or 'none'}")


def _workload(rng: random.Random, block_size: int) -> list[dict[str, Any]]:
    """1 to 3 waves of requests on the same few shared prefixes (some requests with none), n > 1
    siblings, arrivals spread over the first steps of each wave. Before each later wave the soak
    resets vLLM's prefix cache, so that wave finds the prefixes only in host RAM."""
    prefixes = [[rng.randrange(3, 30000) for _ in range(rng.randint(1, 6) * block_size)]
                for _ in range(rng.randint(1, 4))]
    out: list[dict[str, Any]] = []
    for wave in range(rng.choice((1, 2, 2, 3))):
        spread = rng.randint(0, 8)  # arrivals over this many steps
        target = len(out) + rng.randint(4, 10)
        while len(out) < target:
            prefix = rng.choice(prefixes) if rng.random() < 0.85 else []
            prompt = prefix + [rng.randrange(3, 30000) for _ in range(rng.randint(0 if prefix else 1, 24))]
            n = rng.choice((2, 3)) if rng.random() < 0.15 else 1  # n > 1: the frontend's siblings, one prompt
            step, max_tokens = rng.randint(0, spread), rng.randint(1, 8)
            for _ in range(n):
                out.append({"req_id": f"w{wave}-s{len(out):03d}", "prompt": prompt, "max_tokens": max_tokens,
                            "wave": wave, "arrival_step": step})
    return out


DP_LAYOUTS = {"dp2-tp4": "bf16-dp2-tp4", "attndp4-tp2": "bf16-attndp4-tp2"}


def make_scenario(seed: int, mode: str, hosts: int, broken: str | None = None, hybrid: str | None = None,
                  dp: str | None = None) -> Scenario:
    rng = random.Random(f"soak-{seed}")
    block_size = 16
    # The same draws in both modes, so that a pod-slice failure can be replayed in fast mode.
    devices_per_host = rng.choice((1, 2))
    kv_heads_per_host = rng.choice((1, 2, 4))  # 1 on 2 devices: KV heads fewer than the TP shards (padded)
    dtype = rng.choice(("bfloat16", "bfloat16", "float8_e4m3fn", "int8"))
    requests = _workload(rng, block_size)
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    need = -(-longest // block_size) + 1  # one request must fit on its own (at most 10 blocks)
    # A few pool sizes only, so the JAX compilation cache serves every run after the first few.
    storm = rng.random() < 0.4
    if storm:  # preemption storms
        num_blocks = rng.choice([n for n in (12, 16, 24) if n > need])
    else:
        num_blocks = rng.choice((48, 96))
    extra: dict[str, Any] = {"save_timeout_s": 1.0, "load_wait_timeout_s": 1.0,
                             "lazy_offload": rng.random() < 0.3, "save_decode_blocks": rng.random() < 0.3,
                             "save_threads": rng.choice((1, 2, 4))}
    if rng.random() < 0.4:  # host RAM smaller than the working set: LRU eviction
        extra["num_cpu_chunks"] = rng.randint(8, 40)
    else:
        extra["num_cpu_chunks"] = 512
    if rng.random() < 0.2:  # staging budget: saves skipped under backpressure
        extra["num_staging_blocks"] = rng.randint(2, 16)

    def maybe(p: float, value):
        return value if rng.random() < p else type(value)()

    host = lambda: rng.randrange(hosts)  # noqa: E731
    chaos = {
        "seed": seed,
        "write_delay_s": maybe(0.5, round(rng.uniform(0.002, 0.02), 4)),
        "step_delay_s": maybe(0.3, round(rng.uniform(0.001, 0.01 if mode == "fast" else 0.02), 4)),
        "slow_host": None, "slow_host_delay_s": 0.0,
        "fail_d2h_host": None, "fail_d2h_rate": 0.0,
        "lose_slot_host": None, "lose_slot_rate": 0.0,
        "drop_report_rate": maybe(0.4, round(rng.uniform(0.02, 0.1), 3)),
        "duplicate_report_rate": maybe(0.4, round(rng.uniform(0.05, 0.2), 3)),
        "broken": None,
        "abort_rate": maybe(0.5, round(rng.uniform(0.02, 0.1), 3)),
    }
    if rng.random() < 0.4:
        chaos.update(slow_host=host(), slow_host_delay_s=round(rng.uniform(0.01, 0.05), 3))
    if rng.random() < 0.4:
        chaos.update(fail_d2h_host=host(), fail_d2h_rate=round(rng.uniform(0.1, 0.3), 2))
    if rng.random() < 0.4:
        chaos.update(lose_slot_host=host(), lose_slot_rate=round(rng.uniform(0.1, 0.3), 2))
    from tpuoffload.worker.faults import FaultPoint

    names = [p.name for p in FaultPoint]
    point_faults = {"host": host(), "rate": round(rng.uniform(0.05, 0.2), 2),
                    "points": tuple(rng.sample(names, rng.randint(1, len(names))))}
    if rng.random() >= 0.3:
        point_faults = None
    reset_rate = 0.0 if rng.random() < 0.3 else round(rng.uniform(0.02, 0.08), 3)
    settle_between_waves = rng.random() < 0.7  # else a wave's lookups race the last wave's saves
    stall = None
    if broken == "stall":
        stall = (hosts - 1, 3)
    elif broken:
        chaos["broken"] = broken
    if mode == "podslice":
        devices_per_host = 1  # processes are the expensive part; each holds one device
    if hybrid is not None:
        # The layout's devices spread over the hosts; vLLM needs 41 blocks for one 256-token request
        # of the gpt-oss-like layout (16 full-attention blocks, 25 for a window and a prefill chunk).
        from tpuoffload.sim.hybrid_layouts import HYBRID_LAYOUTS

        devices_per_host = max(1, HYBRID_LAYOUTS[hybrid].num_devices // hosts)
        num_blocks = num_blocks if num_blocks >= 48 else 48
    dp_layout, restart_before_wave, restart_cold, shared = None, None, False, False
    if dp is not None:
        # 8 devices on 2 hosts; every rank gets the block pool a scenario without DP would (a tiny
        # one for preemption storms included), so every rank is busy; chaos also aborts requests
        # right after their load failed.
        from tpuoffload.sim.tpu_layouts import LAYOUTS

        dp_layout = DP_LAYOUTS[dp] if dp != "any" else rng.choice(sorted(DP_LAYOUTS.values()))
        ranks = LAYOUTS[dp_layout].dp * LAYOUTS[dp_layout].attn_dp
        # Pod-slice mode: 2 JAX processes x 4 devices (the batch axis spans the hosts); fast mode: the
        # in-process slice holds separate per-host caches, so one host with all 8 devices.
        hosts, devices_per_host = (2, 4) if mode == "podslice" else (1, 8)
        if storm:
            # Each rank serves a share of the requests, and outputs of 1-8 tokens seldom need a new
            # block, so the storm above preempts nothing there: under DP every request decodes
            # 24-56 tokens more, and each rank's pool holds the longest request and half a median
            # one (one block spare), so admitted requests outgrow it as they decode (seeds
            # 7030-7037: 11 preemptions, against 0 with the pool above). Its own generator: every
            # other draw of a seed stays what it was.
            grow = random.Random(f"soak-dp-storm-{seed}")
            for r in requests:
                r["max_tokens"] += grow.randint(24, 56)
            blocks = sorted(-(-(len(r["prompt"]) + r["max_tokens"]) // block_size) for r in requests)
            num_blocks = blocks[-1] + 1 + blocks[len(blocks) // 2] // 2
        num_blocks *= ranks
        # Lazy offload works under DPScheduler; small host RAM keeps its eviction, above the rows
        # every device keeps spare per batch shard (backend/slot_table.py:SHARD_SPARE_ROWS).
        from tpuoffload.backend.slot_table import SHARD_SPARE_ROWS

        if extra["num_cpu_chunks"] < 512:
            extra["num_cpu_chunks"] += SHARD_SPARE_ROWS
        chaos["abort_failed_load_rate"] = maybe(0.6, round(rng.uniform(0.3, 1.0), 2))
        if chaos["lose_slot_host"] is None and rng.random() < 0.5:  # failed loads to abort after
            chaos.update(lose_slot_host=rng.randrange(hosts), lose_slot_rate=round(rng.uniform(0.2, 0.6), 2))
        if chaos["slow_host"] is not None:
            chaos["slow_host"] %= hosts
        for key in ("fail_d2h_host", "lose_slot_host"):
            if chaos[key] is not None:
                chaos[key] %= hosts
        if point_faults is not None:
            point_faults["host"] %= hosts
        # Half the runs put each rank's disk tier below its host RAM (worker/disk_stage.py; the
        # directory is the run's: run_scenario). Its own generator: every other draw of a seed
        # stays what it was.
        disk = random.Random(f"soak-disk-{seed}")
        if disk.random() < 0.5:  # with host RAM small enough to spill, and saves that live to be spilled
            extra["disk_bytes_to_use"] = 1 << 24
            extra["num_cpu_chunks"] = min(extra["num_cpu_chunks"], SHARD_SPARE_ROWS + disk.randint(2, 8))
            extra["save_timeout_s"] = 10.0
        # Warm restart in some runs of two waves or more: before a later wave the slice is shut
        # down cleanly (each host checkpoints every rank's slots) and a new one starts on the same
        # directories; that wave then finds the prefixes in the restored host RAM (and disk). In
        # some, checkpoints every few seconds as well (planned by rank 0's half; saves wait while
        # one is written). Its own generator: every other draw of a seed stays what it was.
        waves = len({r["wave"] for r in requests})
        warm = random.Random(f"soak-restart-{seed}")
        if waves >= 2 and warm.random() < 0.4:
            restart_before_wave = warm.randint(1, waves - 1)
            # Saves that live to be checkpointed (a checkpoint step is slow, and saves wait for it).
            extra.update(persist_timeout_s=30.0, save_timeout_s=max(extra["save_timeout_s"], 10.0))
            if warm.random() < 0.3:
                extra["persist_interval_s"] = round(warm.uniform(0.5, 3.0), 2)
        # The shared tier below host RAM in some runs (a redis-server: run_scenario), with host RAM
        # small enough that later waves find some prefixes only there; in half of those without a
        # warm restart, before a later wave the slice is replaced by a cold one (no checkpoint: a
        # replica that never served these prefixes), which finds them only in the store. Its own
        # generator too.
        tier = random.Random(f"soak-shared-{seed}")
        if tier.random() < 0.3:
            shared = True
            extra["num_cpu_chunks"] = min(extra["num_cpu_chunks"], SHARD_SPARE_ROWS + tier.randint(2, 8))
            extra["save_timeout_s"] = max(extra["save_timeout_s"], 10.0)
            if waves >= 2 and restart_before_wave is None and tier.random() < 0.5:
                restart_before_wave, restart_cold = tier.randint(1, waves - 1), True
    return Scenario(seed=seed, mode=mode, hosts=hosts, devices_per_host=devices_per_host,
                    num_kv_heads=kv_heads_per_host * hosts, dtype=dtype, num_blocks=num_blocks,
                    max_num_seqs=rng.choice((4, 8, 16)), max_num_batched_tokens=rng.choice((64, 128, 256)),
                    extra_config=extra, chaos=chaos, point_faults=point_faults, reset_rate=reset_rate,
                    requests=requests, stall=stall, settle_between_waves=settle_between_waves, hybrid=hybrid,
                    dp_layout=dp_layout, restart_before_wave=restart_before_wave, restart_cold=restart_cold,
                    shared=shared)


# ================================================================ one run (child process)
@dataclass
class RunResult:
    seed: int
    kind: str = "ok"  # "ok" or one of FAILURE_KINDS
    message: str = ""
    knobs: str = ""
    steps: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    chunks_saved: int = 0
    chunks_loaded: int = 0
    load_errors: int = 0
    save_failures: int = 0
    expired: int = 0
    disk_written: int = 0  # chunk files written (spills) and read back (fetches), all hosts
    disk_read: int = 0
    preemptions: int = 0
    # Warm restart: slice restarts, chunks the hosts wrote into checkpoints before it (periodic ones
    # and the shutdown's), restored chunks the new slice's ranks adopted from host RAM and from
    # disk, and loads of restored host-RAM chunks after the restart (fast mode counts them:
    # InProcSlice.restored_loads; None in pod-slice mode).
    restarts: int = 0
    cold_restarts: int = 0  # the slice replaced by a cold one (no checkpoint: the shared tier's runs)
    persist_saved: int = 0
    restored_ready: int = 0
    disk_restored_ready: int = 0
    restored_loaded: int | None = None
    # The shared tier: objects the hosts wrote, chunks fetched back into host RAM (every host
    # verified), objects read.
    shared_written: int = 0
    shared_fetched: int = 0
    shared_read: int = 0
    resets: dict[str, int] = field(default_factory=dict)
    resets_refused: int = 0  # vLLM raised "not supported yet": a running request waits for remote KV
    resets_declined: int = 0  # returned False: blocks still in use (without reset_running_requests)
    mismatches: int = 0
    wrong_outputs: int = 0
    leaks: dict[str, Any] = field(default_factory=dict)
    faults_injected: dict[str, int] = field(default_factory=dict)
    faults_reported: bool = False  # the hosts report what they injected (pod-slice workers do not yet)
    wall_s: float = 0.0


class Hang(Exception):
    pass


def _vllm_leaks(scheduler) -> dict[str, int]:
    """What vLLM itself still holds once every request is done (public scheduler state; under
    DPScheduler its rank processes' combined stats)."""
    stats = scheduler.make_stats()
    out = {"vllm_requests": scheduler.get_num_unfinished_requests(),
           "vllm_running": stats.num_running_reqs, "vllm_waiting": stats.num_waiting_reqs,
           # every block free (prefix-cached blocks are free): usage 0
           "vllm_blocks_held_pct": round(100 * stats.kv_cache_usage, 2)}
    if not hasattr(scheduler, "assigned_dp_rank"):
        pool = scheduler.kv_cache_manager.block_pool
        out["vllm_blocks_held"] = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # minus the null block
    else:
        out["dp_assigned_requests"] = len(scheduler.assigned_dp_rank)
    return {k: v for k, v in out.items() if v}


def _worker_leaks(states: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in states:
        held = {k: s[k] for k in ("inflight_chunks", "staging_bytes") if s.get(k)}
        if not s.get("idle", True):
            held["idle"] = False
        held.update({k: v for k, v in (s.get("idle_report") or {}).items() if v})
        if held:
            out[f"host{s['host']}"] = held
    return out


def _leaks(pod) -> dict[str, int]:
    """What every scheduler half holds (one, or each DP rank's)."""
    return {f"{r.get('source', 'scheduler')}:{k}": v for r in pod.leak_reports() for k, v in r.items()
            if v and k != "source"}


def _stuck(pod) -> str:
    if pod.dp_ranks > 1:
        reqs = {rid: f"rank {rank}" for rid, rank in pod.scheduler.assigned_dp_rank.items()}
    else:
        reqs = {rid: f"{r.status.name}@{r.num_computed_tokens}" for rid, r in pod.scheduler.requests.items()}
    return f"requests left: {reqs}; scheduler halves hold {_leaks(pod)}"


def _progress(pod) -> tuple:
    computed = 0 if pod.dp_ranks > 1 else sum(r.num_computed_tokens for r in pod.scheduler.requests.values())
    return (computed, len(pod.finished), len(pod.aborted), sum(len(v) for v in pod.outputs.values()),
            pod.stats.totals()["chunks_saved"])


def _hybrid_budget(sc: Scenario) -> int:
    """KV memory for which vLLM gives a hybrid scenario its ``num_blocks`` (0: not hybrid)."""
    if sc.hybrid is None:
        return 0
    from tpuoffload.sim.hybrid_layouts import HYBRID_LAYOUTS, kv_cache_config

    probe = 1 << 30
    return sc.num_blocks * (probe // kv_cache_config(HYBRID_LAYOUTS[sc.hybrid], probe, hma=True).num_blocks)


def _with_dirs(sc: Scenario, log_dir: str, shared_url: str | None = None) -> dict[str, Any]:
    """The scenario's config with the run's own directories under ``log_dir`` (a disk tier's, warm
    restart's checkpoints) and the shared tier's URL."""
    extra = dict(sc.extra_config)
    if extra.get("disk_bytes_to_use"):
        extra["disk_path"] = os.path.join(log_dir, "disk-{host}")
    if sc.restart_before_wave is not None and not sc.restart_cold:
        extra["persist_path"] = os.path.join(log_dir, "ckpt")
    if sc.shared:
        if shared_url is None:
            raise ValueError(f"seed {sc.seed} draws the shared tier: run_scenario needs a redis URL")
        extra["shared_url"] = f"{shared_url}?timeout_s=10"
    return extra


def _fresh_dirs(log_dir: str) -> None:
    """A run starts cold: no checkpoint or chunk file of an earlier run of the seed (--repeat)."""
    import glob
    import shutil

    for path in [os.path.join(log_dir, "ckpt")] + glob.glob(os.path.join(log_dir, "disk-*")):
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class _Lives:
    """What the slices of a run that were shut down for a restart did, and then the last
    slice's wrong reads and faults (``run_scenario`` adds its other figures): the requests' outputs,
    the hosts' wrong reads and injected faults, the counters."""

    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)
    steps: int = 0
    preemptions: int = 0
    mismatches: int = 0
    first_mismatch_step: int | None = None
    faults: Counter = field(default_factory=Counter)
    faults_reported: bool = True
    totals: Counter = field(default_factory=Counter)

    def add_states(self, states: list[dict], pod) -> None:
        self.mismatches += sum(s["mismatches"] for s in states)
        if self.first_mismatch_step is None and pod.first_mismatch_step is not None:
            self.first_mismatch_step = self.steps + pod.first_mismatch_step
        self.faults_reported &= all("faults_injected" in s for s in states)
        for s in states:
            self.faults.update(s.get("faults_injected") or {})

    def add_slice(self, pod) -> None:
        self.outputs.update(pod.outputs)  # request ids are unique across waves
        self.finished |= pod.finished
        self.aborted |= pod.aborted
        self.steps += pod.steps
        self.preemptions += pod.preemptions
        self.totals.update(pod.stats.totals())


class RestartLost(Exception):
    """A warm restart on one host whose ranks did not answer every chunk the host restored."""


def _shut_down(pod, lives: _Lives, res: RunResult, settled: bool, cold: bool) -> None:
    """The first half of a restart: the record of ``pod`` (every host's wrong reads and faults
    and, with the last wave settled, whatever is held, as at the end of a run), then its clean
    shutdown (every host writes its checkpoint, unless ``cold``)."""
    from tpuoffload import counters as C

    states = pod.worker_state()
    lives.add_states(states, pod)
    if settled:
        held = {**_leaks(pod), **_vllm_leaks(pod.scheduler), **_worker_leaks(states)}
        res.leaks.update({f"before restart {res.restarts + res.cold_restarts + 1}: {k}": v for k, v in held.items()})
    hosts = pod.shutdown()
    lives.add_slice(pod)
    if cold:
        res.cold_restarts += 1
        return
    res.restarts += 1
    res.persist_saved += sum(h.get(C.PERSIST_SAVED_CHUNKS, 0) for h in hosts)


def _warm_up(pod, restart: int, max_steps: int = 30) -> None:
    """The second half: empty steps on the new slice (at least 4) until every rank's half has
    answered every chunk the hosts restored (DPScheduler does not ask has_pending_push_work, so
    without them the restore reports would wait for the next request). On one host each restored
    chunk must be answered within them: adopted, or dropped because the rank adopted another copy
    of its hash (a save the scheduler had expired stays committed on the host, and a later save of
    the same prefix went to another slot: both are in the checkpoint). No other host can disagree,
    and no save or reset comes before the reports, so nothing else excuses a drop there; with
    several hosts a chunk one host failed to save is dropped too."""
    from tpuoffload import counters as C

    for i in range(max_steps):
        pod.step()
        t = pod.stats.totals()
        restored, answered = t[C.PERSIST_RESTORED_CHUNKS], t[C.RESTORED_READY] + t[C.RESTORED_DROPPED]
        if i >= 3 and answered * pod.spec.num_hosts >= restored:
            break
    if pod.spec.num_hosts == 1 and answered != restored:
        raise RestartLost(f"warm restart {restart}: the host restored {restored} chunks, its ranks adopted "
                          f"{t[C.RESTORED_READY]} and dropped {t[C.RESTORED_DROPPED]} after {i + 1} empty steps")


def run_scenario(sc: Scenario, log_dir: str, stall_s: float, max_steps: int,
                 shared_store: "SharedStore | None" = None) -> RunResult:
    """One run. Never raises: every failure becomes the result's kind and message. ``shared_store``:
    the store of a scenario with the shared tier (emptied first)."""
    from tpuoffload import counters as C
    from tpuoffload.sim.podslice import DigestMismatch, PodSlice, SliceError, SliceSpec
    from tpuoffload.sim.chaos import Chaos, PointFaults
    from tpuoffload.sim.vllm_setup import make_request
    from tpuoffload.sim.workload import expected_output

    t0 = time.monotonic()
    res = RunResult(seed=sc.seed, knobs=sc.knobs(), requests=len(sc.requests))
    rng = random.Random(f"soak-driver-{sc.seed}")
    _fresh_dirs(log_dir)
    chaos = Chaos(**sc.chaos)
    pf = PointFaults(**sc.point_faults) if sc.point_faults else None
    pod = None
    lives = _Lives()  # the slices shut down for a restart
    try:
        shared_url = None
        if sc.shared and shared_store is not None:
            shared_store.flush()  # nothing of an earlier run
            shared_url = shared_store.url
        spec = SliceSpec(num_hosts=sc.hosts, devices_per_host=sc.devices_per_host, num_kv_heads=sc.num_kv_heads,
                         dtype=sc.dtype, num_blocks=sc.num_blocks,
                         max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                         extra_config=_with_dirs(sc, log_dir, shared_url), step_timeout_s=30.0,
                         hybrid=sc.hybrid, kv_budget_bytes=_hybrid_budget(sc),
                         max_model_len=256 if sc.hybrid else 0, layout=sc.dp_layout)

        def start():
            if sc.mode == "fast":
                from tpuoffload.sim.inproc_slice import InProcSlice

                return InProcSlice(spec, chaos, log_dir=log_dir, point_faults=pf, stall=sc.stall)
            return PodSlice(spec, chaos, log_dir=log_dir, point_faults=pf)

        pod = start()
        last, last_change = None, time.monotonic()
        for wave in sorted({r["wave"] for r in sc.requests}):
            if wave:
                if sc.settle_between_waves and not pod.settle(30.0):
                    raise Hang(f"saves unresolved 30 s after wave {wave - 1}; {_stuck(pod)}")
                if wave == sc.restart_before_wave:  # a new slice: HBM empty, host RAM (and disk) restored
                    _shut_down(pod, lives, res, sc.settle_between_waves, sc.restart_cold)
                    pod = None
                    pod = start()
                    if not sc.restart_cold:
                        _warm_up(pod, res.restarts)
                    last = None
                else:
                    res.resets_declined += not pod.scheduler.reset_prefix_cache()  # HBM forgets; host RAM remains
            arrivals: dict[int, list[dict]] = {}
            for r in sc.requests:
                if r["wave"] == wave:
                    arrivals.setdefault(r["arrival_step"], []).append(r)
            step = 0
            while arrivals or pod.scheduler.has_requests():
                for r in arrivals.pop(step, ()):
                    pod.add_request(make_request(r["req_id"], r["prompt"], max_tokens=r["max_tokens"]))
                if sc.reset_rate and rng.random() < sc.reset_rate:
                    kind = rng.choice(RESET_KINDS if sc.dp_layout is None else DP_RESET_KINDS)
                    res.resets[kind] = res.resets.get(kind, 0) + 1
                    try:
                        res.resets_declined += not pod.scheduler.reset_prefix_cache(
                            reset_running_requests="running" in kind, reset_connector="connector" in kind)
                    except RuntimeError:  # vLLM: requests waiting for remote KV hold blocks
                        res.resets_refused += 1
                pod.step()
                step += 1
                now = time.monotonic()
                mark = _progress(pod)
                if mark != last:
                    last, last_change = mark, now
                elif now - last_change > stall_s and not arrivals:
                    raise Hang(f"no progress for {stall_s:.0f} s after step {lives.steps + pod.steps}; {_stuck(pod)}")
                else:
                    time.sleep(0.002)  # nothing moved: do not spin empty steps
                if lives.steps + pod.steps >= max_steps:
                    raise Hang(f"not done after {max_steps} steps; {_stuck(pod)}")
        if not pod.settle(30.0):
            res.leaks["unsettled"] = _leaks(pod)
        states = pod.worker_state()
        lives.add_states(states, pod)
        res.mismatches = lives.mismatches
        res.faults_reported = lives.faults_reported
        res.faults_injected = dict(lives.faults)
        res.leaks.update(_leaks(pod))
        res.leaks.update(_vllm_leaks(pod.scheduler))
        res.leaks.update(_worker_leaks(states))
        # Every request, whichever slice served it (a warm restart ends one slice and starts another).
        outputs = {**lives.outputs, **pod.outputs}
        finished, aborted = lives.finished | pod.finished, lives.aborted | pod.aborted
        wrong = []
        for r in sc.requests:
            want = expected_output(r["prompt"], r["max_tokens"], 32000)
            got = outputs.get(r["req_id"], [])
            if r["req_id"] in aborted:
                ok = got == want[:len(got)]
            else:
                ok = r["req_id"] in finished and got == want
            if not ok:
                wrong.append(r["req_id"])
        res.wrong_outputs = len(wrong)
        if res.mismatches or wrong:
            res.kind = "mismatch"
            res.message = (f"{res.mismatches} context positions wrong (first at step {lives.first_mismatch_step}), "
                           f"wrong outputs: {wrong[:8]}")
        elif res.leaks:
            res.kind = "leak"
            res.message = f"held after settling: {res.leaks}"
    except DigestMismatch as e:
        res.kind, res.message = "digest", str(e)
    except Hang as e:
        res.kind, res.message = "hang", str(e)
    except SliceError as e:
        res.kind = "hang" if "did not answer" in str(e) or "more than" in str(e) else "error"
        res.message = str(e)
    except Exception as e:  # noqa: BLE001 - a soak records every failure and goes on
        import traceback

        res.kind, res.message = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        totals, steps, preemptions = Counter(lives.totals), lives.steps, lives.preemptions
        finished, aborted = set(lives.finished), set(lives.aborted)
        if pod is not None:
            last_totals = pod.stats.totals()
            totals.update(last_totals)
            steps, preemptions = steps + pod.steps, preemptions + pod.preemptions
            finished |= pod.finished
            aborted |= pod.aborted
            if res.restarts:  # what the slice after the restart adopted and loaded
                res.restored_ready = last_totals[C.RESTORED_READY]
                res.disk_restored_ready = last_totals[C.DISK_RESTORED_READY]
                loads = getattr(pod, "restored_loads", None)
                res.restored_loaded = min(loads) if loads else None  # a chunk counts once every host loaded it
            pod.close()
        res.steps = steps
        res.finished = len(finished & {r["req_id"] for r in sc.requests})
        res.aborted = len(aborted)
        res.chunks_saved, res.chunks_loaded = totals[C.CHUNKS_SAVED], totals[C.CHUNKS_LOADED]
        res.load_errors, res.save_failures = totals[C.LOAD_ERRORS], totals[C.SAVE_FAILURES]
        res.expired = totals[C.LEDGER_EXPIRED]
        res.disk_written, res.disk_read = totals[C.DISK_WRITTEN_CHUNKS], totals[C.DISK_READ_CHUNKS]
        res.shared_written, res.shared_read = totals[C.SHARED_WRITTEN_CHUNKS], totals[C.SHARED_READ_CHUNKS]
        res.shared_fetched = totals[C.SHARED_FETCHES_READY]
        res.preemptions = preemptions
    res.wall_s = time.monotonic() - t0
    return res


class SharedStore:
    """The child's redis-server for the seeds that draw the shared tier (tpuoffload.sim.redis_server:
    a free port, no persistence, its own process group under ``timeout -s KILL lifetime_s``).
    It dies with the child: the child stops it before it exits (also when its parent disappears),
    and the parent, told its process group in the child's "ready" event, kills that group with
    the child's (``_Child.kill``)."""

    def __init__(self, lifetime_s: int) -> None:
        from tpuoffload.sim.redis_server import RedisServer

        self.server = RedisServer(lifetime_s=lifetime_s)
        self.pgid = self.server.proc.pid  # a session of its own: its pid is its process group

    @property
    def url(self) -> str:
        return self.server.url

    def flush(self) -> None:
        import socket

        with socket.create_connection(("127.0.0.1", self.server.port), timeout=10) as s:
            s.sendall(b"FLUSHALL\r\n")
            reply = s.recv(64)
        if not reply.startswith(b"+OK"):
            raise RuntimeError(f"redis FLUSHALL answered {reply!r}")

    def stop(self) -> None:
        self.server.stop()


_STORE: SharedStore | None = None  # the child's (child_main)


def _stop_store() -> None:
    if _STORE is not None:
        _STORE.stop()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    _stop_store()
    os._exit(3)


def child_main(args: argparse.Namespace) -> None:
    """Run seeds ``args.seeds`` one after another, one JSON line per event on ``args.result_fd``."""
    out = os.fdopen(args.result_fd, "w", buffering=1)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()

    def emit(**event):
        out.write(json.dumps(event) + "\n")

    import tpuoffload.sim.podslice  # noqa: F401  (imports vLLM and JAX before the first deadline starts)
    if args.mode == "fast":
        import tpuoffload.sim.inproc_slice  # noqa: F401
    global _STORE
    seeds = list(map(int, args.seeds.split(",")))
    scenarios = [make_scenario(seed, args.mode, args.hosts, args.broken, args.hybrid, args.dp) for seed in seeds]
    if any(sc.shared for sc in scenarios):  # outlives no deadline of the batch (the parent's backstop)
        _STORE = SharedStore(lifetime_s=int(len(seeds) * (args.run_timeout or DP_RUN_TIMEOUT) + 600))
    emit(event="ready", store_pgid=_STORE.pgid if _STORE is not None else None)
    for sc in scenarios:
        emit(event="start", seed=sc.seed)
        log_dir = os.path.join(args.log_dir, f"seed-{sc.seed}")
        res = run_scenario(sc, log_dir, args.stall_s, args.max_steps, _STORE)
        emit(event="result", result=dataclasses.asdict(res))
    out.flush()
    _stop_store()
    os._exit(0)  # skip the slow interpreter teardown of torch/vLLM/JAX


# ================================================================ the parent: deadlines and the table
class _Child:
    """One child process running a batch of seeds; its events come over a pipe."""

    def __init__(self, args: argparse.Namespace, seeds: list[int], log_path: str) -> None:
        r, w = os.pipe()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--result-fd", str(w), "--mode", args.mode,
               "--hosts", str(args.hosts), "--seeds", ",".join(map(str, seeds)), "--log-dir", args.log_dir,
               "--stall-s", str(args.stall_s), "--max-steps", str(args.max_steps),
               "--run-timeout", str(args.run_timeout)]
        if args.broken:
            cmd += ["--broken", args.broken]
        if args.hybrid:
            cmd += ["--hybrid", args.hybrid]
        if args.dp:
            cmd += ["--dp", args.dp]
        env = dict(os.environ)
        devices = (8 if args.dp else args.hosts * 2) if args.mode == "fast" else 1
        env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONUNBUFFERED="1")
        if args.jax_cache_dir:
            env.update(JAX_COMPILATION_CACHE_DIR=args.jax_cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=REPO,
                                         pass_fds=(w,), start_new_session=True)
        os.close(w)
        self.fd = r
        os.set_blocking(r, False)
        self.buf = b""
        self.store_pgid: int | None = None  # the child's redis-server's process group (its "ready" event)

    def next_event(self, deadline: float) -> dict | None:
        """The next event, or None if the deadline passed or the child died without one."""
        while True:
            if b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                return json.loads(line)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    return None  # the child exited
                self.buf += chunk

    def kill(self) -> None:
        """SIGKILL the child's process group and its redis-server's, and reap the child; safe to
        call twice."""
        if self.fd is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.store_pgid is not None and _is_redis_group(self.store_pgid):  # not a pid reused since
            try:
                os.killpg(self.store_pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass
        os.close(self.fd)
        self.fd = None

    def exit_status(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 32 * 1024))
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"


def _is_redis_group(pgid: int) -> bool:
    """Whether process ``pgid`` still runs a redis-server (SharedStore's ``timeout`` around it)."""
    try:
        with open(f"/proc/{pgid}/cmdline", "rb") as f:
            return b"redis-server" in f.read()
    except OSError:
        return False


def replay_command(args: argparse.Namespace, seed: int) -> str:
    cmd = [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else sys.executable,
           "tools/soak.py", "--mode", args.mode, "--hosts", str(args.hosts), "--seed", str(seed), "--runs", "1"]
    if args.broken:
        cmd += ["--broken", args.broken]
    if args.hybrid:
        cmd += ["--hybrid", args.hybrid]
    if args.dp:
        cmd += ["--dp", args.dp]
    return f"cd {shlex.quote(REPO)} && " + " ".join(map(shlex.quote, cmd))


def _line(i: int, total: int, r: RunResult) -> str:
    head = f"[{i:>4}/{total}] seed {r.seed:<8}"
    stats = (f"{r.steps:>4} steps {r.requests:>3} req ({r.finished} done, {r.aborted} aborted) "
             f"{r.chunks_saved + r.chunks_loaded:>5} chunks, {r.preemptions} preempted, "
             f"{sum(r.resets.values())} resets, {r.wall_s:5.1f}s")
    if r.kind == "ok":
        return f"{head} ok     {stats}"
    first = r.message.splitlines()[0] if r.message else ""
    return f"{head} FAIL {r.kind}: {first[:300]}\n{'':>20}{stats}\n{'':>20}{r.knobs}"


def _restart_row(results: list[RunResult]) -> str:
    runs = [r for r in results if r.restarts]
    if not runs:
        return "none drawn"
    counted = [r.restored_loaded for r in runs if r.restored_loaded is not None]
    loaded = (f"{sum(counted)} restored chunks loaded after the restart ({sum(1 for n in counted if n)} of "
              f"{len(counted)} runs loaded some)" if counted else "restored loads not counted (pod-slice hosts)")
    files = sum(r.disk_restored_ready for r in runs)
    return (f"{len(runs)} runs restarted, {sum(r.persist_saved for r in runs)} chunks checkpointed, "
            f"{sum(r.restored_ready for r in runs)} restored chunks adopted (+{files} chunk files), {loaded}")


def _shared_row(results: list[RunResult]) -> str:
    runs = [r for r in results if r.shared_written or "shared tier" in r.knobs]
    if not runs:
        return "none drawn"
    cold = sum(1 for r in runs if r.cold_restarts)
    return (f"{len(runs)} runs ({cold} with a cold new slice), {sum(r.shared_written for r in runs)} objects written, "
            f"{sum(r.shared_fetched for r in runs)} chunks fetched back ({sum(r.shared_read for r in runs)} objects "
            f"read); {sum(1 for r in runs if r.shared_fetched)} runs fetched some")


def render_table(args: argparse.Namespace, results: list[RunResult], wall_s: float) -> str:
    failed = [r for r in results if r.kind != "ok"]
    kinds = Counter(r.kind for r in failed)
    resets = Counter()
    faults = Counter()
    for r in results:
        resets.update(r.resets)
        faults.update(r.faults_injected)
    n = len(results)
    rows = [
        ("runs", f"{n} ({n - len(failed)} passed, {len(failed)} failed)"),
        ("steps", f"{sum(r.steps for r in results)}"),
        ("requests", f"{sum(r.requests for r in results)} ({sum(r.finished for r in results)} finished, "
                     f"{sum(r.aborted for r in results)} aborted)"),
        ("chunks moved", f"{sum(r.chunks_saved + r.chunks_loaded for r in results)} "
                         f"({sum(r.chunks_saved for r in results)} saved, {sum(r.chunks_loaded for r in results)} "
                         f"loaded, all hosts)"),
        ("load errors", f"{sum(r.load_errors for r in results)} (recomputed)"),
        ("save failures", f"{sum(r.save_failures for r in results)}; expired {sum(r.expired for r in results)}"),
        ("disk tier", f"{sum(r.disk_written for r in results)} chunk files written, "
                      f"{sum(r.disk_read for r in results)} read back (all hosts)"),
        ("warm restart", _restart_row(results)),
        ("shared tier", _shared_row(results)),
        ("preemptions", f"{sum(r.preemptions for r in results)}"),
        ("resets", f"{sum(resets.values())} ({', '.join(f'{k} {resets[k]}' for k in RESET_KINDS)}); vLLM "
                   f"declined {sum(r.resets_declined for r in results)} (blocks in use), refused "
                   f"{sum(r.resets_refused for r in results)} (a request waits for remote KV)"),
        ("faults injected", (", ".join(f"{k} {v}" for k, v in sorted(faults.items())) or "none")
         if any(r.faults_reported for r in results) else "not reported by these hosts"),
        ("mismatches", f"{kinds['mismatch']} runs ({sum(r.mismatches for r in results)} context positions, "
                       f"{sum(r.wrong_outputs for r in results)} wrong outputs); digest divergences "
                       f"{kinds['digest']} runs"),
        ("hangs", f"{kinds['hang']}"),
        ("leaks", f"{kinds['leak']}"),
        ("errors", f"{kinds['error'] + kinds['crash']}"),
        ("wall time", f"{wall_s:.0f} s, {wall_s / max(n, 1):.1f} s per run"),
    ]
    width = max(len(k) for k, _ in rows)
    title = (f"soak --mode {args.mode} --hosts {args.hosts}" + (f" --broken {args.broken}" if args.broken else "")
             + (f" --hybrid {args.hybrid}" if args.hybrid else "") + (f" --dp {args.dp}" if args.dp else "")
             + f"  (scenarios v{SCENARIO_VERSION})")
    lines = [title, "-" * len(title)] + [f"{k:<{width}}  {v}" for k, v in rows]
    if failed:
        lines.append(f"{'failed seeds':<{width}}  " + ", ".join(f"{r.seed} ({r.kind})" for r in failed))
        lines.append(f"{'replay one':<{width}}  {replay_command(args, failed[0].seed)}")
    else:
        lines.append(f"{'failed seeds':<{width}}  none")
    return "\n".join(lines)


def _next_result(args: argparse.Namespace, child: _Child, seed: int) -> tuple[RunResult, bool]:
    """Wait for ``seed``'s run under the per-run deadline. Returns (result, the child is gone):
    past the deadline the child's process group is killed and the run counts as a hang."""
    deadline = time.monotonic() + args.run_timeout
    event = child.next_event(deadline)
    if event is not None and event.get("event") == "start":
        event = child.next_event(deadline)
        if event is not None and event.get("event") == "result":
            return RunResult(**event["result"]), False
    timed_out = event is None and child.proc.poll() is None
    status = f"killed after {args.run_timeout:.0f} s" if timed_out else f"child {child.exit_status()}"
    child.kill()
    sc = make_scenario(seed, args.mode, args.hosts, args.broken, args.hybrid, args.dp)
    return RunResult(seed=seed, kind="hang" if timed_out else "crash", knobs=sc.knobs(), requests=len(sc.requests),
                     message=f"run {status}; last lines of {child.log_path}:\n{child.tail()}"), True


def parent_main(args: argparse.Namespace) -> int:
    os.makedirs(args.log_dir, exist_ok=True)
    seeds = [args.seed + i for i in range(args.runs) for _ in range(args.repeat)]
    print(f"soak: {len(seeds)} {args.mode} runs on {args.hosts} hosts, seeds {seeds[0]}..{seeds[-1]}, "
          f"deadline {args.run_timeout:.0f} s per run; logs in {args.log_dir}", flush=True)
    t0 = time.monotonic()
    results: list[RunResult] = []
    batch = 0
    while len(results) < len(seeds):
        # A fresh child every --runs-per-child runs: one process running hundreds of layouts keeps
        # their compiled programs and ran out of memory mappings (LLVM "Cannot allocate memory")
        # after ~320 runs, which read as hangs (seeds 10328, 10642, 10976 of the first 1000-run soak).
        todo = seeds[len(results):len(results) + args.runs_per_child]
        child = _Child(args, todo, os.path.join(args.log_dir, f"child-{batch}.log"))
        batch += 1
        event = child.next_event(time.monotonic() + args.start_timeout)
        if event is None or event.get("event") != "ready":
            why = child.exit_status() if event is None else f"unexpected {event}"
            child.kill()
            print(f"soak: the child process did not start ({why}); last lines of {child.log_path}:\n{child.tail()}",
                  file=sys.stderr)
            return 2
        child.store_pgid = event.get("store_pgid")
        for seed in todo:
            res, child_gone = _next_result(args, child, seed)
            results.append(res)
            print(_line(len(results), len(seeds), res), flush=True)
            if args.verbose_failures and res.kind != "ok":
                print("\n".join("    " + line for line in res.message.splitlines()[:60]), flush=True)
            if child_gone:
                break
        child.kill()
    wall = time.monotonic() - t0
    print()
    print(render_table(args, results, wall), flush=True)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump({"results": [dataclasses.asdict(r) for r in results], "wall_s": wall,
                       "replay": {r.seed: replay_command(args, r.seed) for r in results if r.kind != "ok"}}, f)
    return 0 if all(r.kind == "ok" for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("fast", "podslice"), default="fast")
    p.add_argument("--hosts", type=int, default=2, help="hosts of the slice (podslice: 2, 4 or 8 processes)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--runs-per-child", type=int, default=100,
                   help="start a fresh child process after this many runs (bounds what one process accumulates)")
    p.add_argument("--seed", type=int, default=0, help="first seed; run i uses seed + i")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each seed this many times (to replay a failure that depends on thread timing)")
    p.add_argument("--run-timeout", type=float, default=None,
                   help="per-run deadline in seconds, then the run is killed and counts as a hang "
                        "(default 60 fast, 240 podslice)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="deadline for a child's imports")
    p.add_argument("--stall-s", type=float, default=15.0, help="no progress for this long is a hang")
    p.add_argument("--max-steps", type=int, default=2000, help="more steps than this is a hang")
    p.add_argument("--broken", default=None,
                   help="negative control: host_order (a host dispatches in another order), background_dispatch, "
                        "or stall (fast mode: the last host stops answering at step 3)")
    p.add_argument("--hybrid", default=None,
                   help="podslice mode: a hybrid layout of tpuoffload.sim.hybrid_layouts (e.g. gpt-oss-like)")
    p.add_argument("--dp", choices=("any", *DP_LAYOUTS), default=None,
                   help="data parallelism through tpu-inference's DPScheduler on 8 devices: DP 2 x TP 4, "
                        "attention DP 4 x TP 2, or any (the seed picks)")
    p.add_argument("--log-dir", default=None, help="child logs and pod-slice host logs (default: a temp dir)")
    p.add_argument("--jax-cache-dir", default=os.path.join(tempfile.gettempdir(), "tpuoffload-soak-jax-cache"),
                   help="JAX persistent compilation cache shared by all runs ('' to disable)")
    p.add_argument("--summary-json", default=None, help="also write every run's result here")
    p.add_argument("--verbose-failures", action="store_true", help="print each failure's full message")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seeds", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hosts < 1 or args.runs < 1 or args.repeat < 1:
        p.error("--hosts, --runs and --repeat must be positive")
    if args.broken == "stall" and args.mode != "fast":
        p.error("--broken stall is a fast-mode control")
    if args.hybrid and args.mode != "podslice":
        p.error("--hybrid runs in podslice mode")
    if args.dp and args.hybrid:
        p.error("--dp with --hybrid: several KV cache groups under DPScheduler are not supported yet")
    if args.child:
        child_main(args)
        return 0
    if args.run_timeout is None:
        args.run_timeout = DP_RUN_TIMEOUT if args.dp else DEFAULT_RUN_TIMEOUT[args.mode]
    if args.log_dir is None:
        args.log_dir = tempfile.mkdtemp(prefix=f"soak-{args.mode}-")
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
