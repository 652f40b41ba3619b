#!/usr/bin/env python
"""Scheduler-side cost per engine step of a KV connector, on vLLM's real Scheduler (CPU, no model).

Five configurations of the same vLLM 0.32 ``Scheduler`` run the same requests in one process,
taking turns of --steps-per-turn steps in an order shuffled every round, so drift in machine speed
hits all of them alike and no config always runs right after the same other one. With one step
per turn (the default) every step runs on the caches another config's step left (OffloadingConnector's
churns the most); with more, most steps follow their own scheduler's previous step, as in a
serving engine, where one scheduler runs per engine process:

  (a) none        no KV connector
  (b) offloading  vLLM's own OffloadingConnector, CPUOffloadingSpec backend
  (c) tpuoffload  tpuoffload.connector.TPUOffloadConnector
  (d) null        a connector whose hooks do nothing (tools/bench_connectors.py:NullConnector): what
                  vLLM itself adds for having a KV connector, a floor for (b) and (c)
  (e) same hits   a connector that only finds hits (tools/bench_connectors.py:SameHitsConnector:
                  the prompt hashes of finished requests by first block, loads acknowledged at once,
                  nothing saved or moved): with hits, vLLM's own steps change (a request waits a
                  step for its load; each step then carries more requests than (a)'s), and (e)
                  pays exactly that, so (b) and (c) "net of (e)" is what the connector itself adds

Timed per step: ``scheduler.schedule()`` + ``scheduler.update_from_output()``, in wall-clock time
(perf_counter_ns) and in this thread's CPU time (thread_time_ns: immune to the process being
descheduled, so steadier on a busy machine; a few us of clock-call overhead, the same in every
config). That covers every connector hook vLLM calls on the scheduler side (lookups, allocation hooks,
build_connector_meta, update_connector_output, request_finished, stats, events). No worker runs:
a fake runner samples one token for every request that samples (nothing for a partial prefill)
and acknowledges everything the connector asked for in that same step (the fastest possible
worker):

  * TPUOffloadConnector: an OffloadWorkerReport confirming every save id of ``meta.save`` and
    ``meta.flush`` from every host, ``finished_recving`` = the req ids of ``meta.loads``,
    ``finished_sending`` = ``meta.release_req_ids``, ``invalid_block_ids`` = the loads'
    ``unavailable_block_ids`` (what OffloadWorker reports as load errors).
  * OffloadingConnector: what its worker (offloading/worker.py) sends: an OffloadingWorkerMetadata
    with ``completed_jobs[job_id] = num_workers`` for every load and store job of the step's
    metadata, ``finished_recving`` = the req ids of the load jobs; it never sends finished_sending.
    (The real worker defers a store to the next step; completing it at once only makes the
    in-flight job table smaller.)

Workload (same prompts, token for token, in every configuration; "reset" = vLLM's own prefix
cache is reset while host RAM keeps its chunks, so host RAM is the only place a prefix can come from):

  wave 0 (untimed warm-up)  R fresh prompts, 2 output tokens each: fills host RAM
  --rounds times:
    reset; "prefill+hits"   R prompts, --hit-fraction of them starting with the first half of a
                            wave-0 prompt (lookups hit, async loads); 2 output tokens each, timed
                            from admission until all finished. (a) has no host RAM and recomputes
                            those prefixes, so it runs fewer tokens per step and more steps
    reset; "prefill cold"   R fresh prompts, 2 output tokens each, timed until all finished: every
                            prompt block is saved, every lookup misses
  --rounds times:
    reset; "ramp"           R fresh prompts with long max_tokens, timed until every one sampled its
                            first token (prefills while more and more requests decode); aborted
                            then, except in the last round, whose requests go on to decode
  "decode"                  --warmup untimed steps, then --steps timed steps: R requests running,
                            one token each per step (the steady state)

For the two prefill phases, measurement 1 also prints the whole phase's CPU time per request: with
hits the connectors need fewer steps than (a), each carrying more requests, which a per-step figure
charges to them.

Measurement 1b repeats measurement 1 with the connectors' scheduler-side hooks wrapped in timers
(perf_counter_ns): the time spent inside the connector itself, per step (skip with --no-hooks).

Measurement 2: the same workload for the no-connector scheduler and TPUOffloadConnector with its
host index pre-filled with N READY chunks of random hashes (allocated, registered in the ledger,
confirmed by every host and marked READY through the scheduler half's own index and ledger). Every config has room for all it saves (no eviction), plus one
whose capacity is exactly the largest fill, so that every save evicts.

Measurement 3 (--events, instead of 1, 1b and 2): KV events off and on, side by side. Events on =
vLLM's ``--kv-events-config`` with its real ZMQ publisher (bound on an ipc socket, so every batch is
encoded and sent on its thread as in serving), for the no-connector scheduler and for
TPUOffloadConnector; all four take turns on the same workload. vLLM's own HBM events are part of
both "on" configs, so what tpuoffload's events add per step is ((c) on - (c) off) - ((a) on - (a)
off); the time inside the connector's hooks (timed in both (c) configs) is printed too.

GC: by default the collector is disabled inside every timed phase (gc.collect() just before), so
numbers are free of collection pauses; --gc on keeps it enabled (then p90/max show the pauses,
which grow with the number of live Python objects, e.g. chunks held).

    python tools/bench_scheduler.py                       # defaults, well under 3 minutes
    python tools/bench_scheduler.py --requests 512 --steps 500 --prompt-len 2048 --fills 0,1000000
    python tools/bench_scheduler.py --events                # KV events off vs on
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256, help="concurrent requests (max_num_seqs)")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=50, help="untimed decode steps before the timed ones")
    p.add_argument("--prompt-len", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--hit-fraction", type=float, default=0.5,
                   help="fraction of wave-1 requests whose first half prompt is in host RAM")
    p.add_argument("--hosts", type=int, default=1,
                   help="reporting workers (world size); each confirms every save")
    p.add_argument("--cpu-chunks", type=int, default=1 << 17,
                   help="host RAM capacity in chunks (one block each) for the main comparison")
    p.add_argument("--fills", default="0,100000,1000000",
                   help="comma-separated READY chunk counts for the index-size measurement ('' to skip)")
    p.add_argument("--gc", choices=("off", "on"), default="off", help="garbage collector during timed phases")
    p.add_argument("--steps-per-turn", type=int, default=1,
                   help="steps each config runs in a row before the next one's turn: 1 runs every step on "
                        "the caches another config's step left; more lets most steps follow their own "
                        "scheduler's previous step, as in a serving engine (see round_robin)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the timed waves: prefill with hits, prefill cold, ramp")
    p.add_argument("--no-hooks", dest="hooks", action="store_false",
                   help="skip measurement 1b (a second run with the connector hooks timed)")
    p.add_argument("--events", action="store_true",
                   help="measurement 3 only: KV events off and on, side by side (vLLM's ZMQ publisher)")
    p.add_argument("--profile", metavar="FILE", default=None,
                   help="also cProfile TPUOffloadConnector's hooks during the main run, dump stats to FILE")
    args = p.parse_args(argv)
    for name in ("requests", "steps", "prompt_len", "block_size", "max_batched_tokens", "hosts", "cpu_chunks",
                 "rounds", "steps_per_turn"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0.0 <= args.hit_fraction <= 1.0:
        p.error("--hit-fraction must be in [0, 1]")
    if args.prompt_len < 2 * args.block_size:
        p.error("--prompt-len must be at least two blocks")
    args.fill_list = [int(x) for x in args.fills.split(",") if x.strip()] if args.fills else []
    return args


# ---------------------------------------------------------------------------------------- configs
@dataclass
class Sim:
    name: str
    kind: str  # "none" | "offloading" | "tpu" | "null" | "hits"
    sched: object = None
    events: bool = False  # vLLM publishes KV events (--kv-events-config)
    hosts: int = 1
    fill: int = 0
    times: dict = field(default_factory=dict)  # phase -> [(wall sched ns, wall update ns, cpu ns, hook ns)]
    acked: Counter = field(default_factory=Counter)  # saves / loads / releases acknowledged
    wave: list = field(default_factory=list)  # Request objects of the current wave
    token: int = 100
    counter: int = 0
    hook_ns: list | None = None  # [ns spent inside connector hooks], when --hooks wrapped them

    # ---- the fake worker ----
    def emulate(self, so):
        from vllm.v1.outputs import ModelRunnerOutput

        reqs = self.sched.requests
        req_ids = list(so.num_scheduled_tokens)
        self.token = self.token + 1 if self.token < 30000 else 100
        tok = [self.token]
        sampled = []
        for r in req_ids:
            req = reqs[r]
            # schedule() already advanced num_computed_tokens by the scheduled tokens: a request
            # samples iff that reaches its length (decode, or the last prefill chunk).
            sampled.append(tok if req.num_computed_tokens >= req.num_tokens else [])
        kv_out = None
        if self.kind == "null":
            from vllm.v1.outputs import KVConnectorOutput

            kv_out = KVConnectorOutput()
        elif self.kind == "hits":
            kv_out = self._ack_hits(so.kv_connector_metadata)
        elif self.kind == "tpu":
            kv_out = self._ack_tpu(so.kv_connector_metadata.plan)
        elif self.kind == "offloading":
            kv_out = self._ack_offloading(so.kv_connector_metadata)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def _ack_tpu(self, meta):
        from vllm.v1.outputs import KVConnectorOutput

        from tpuoffload.messages import OffloadWorkerReport, metadata_bytes

        save_ids = [*meta.save.save_ids, *meta.flush.save_ids]
        report = None
        if save_ids:
            report = OffloadWorkerReport()
            for h in range(self.hosts):
                report = report.aggregate(OffloadWorkerReport.from_host(h, save_ids))
            # What the step's plan costs on the wire to every host (pickled, as the executors ship it).
            self.acked["meta_bytes"] += metadata_bytes(meta)
            self.acked["meta_steps"] += 1
        invalid = {b for load in meta.loads for b in load.unavailable_block_ids}
        self.acked["saves"] += len(save_ids)
        self.acked["loads"] += len(meta.loads)
        self.acked["load_blocks"] += sum(len(load.block_ids) for load in meta.loads)
        self.acked["releases"] += len(meta.release_req_ids)
        return KVConnectorOutput(
            finished_sending=set(meta.release_req_ids) or None,
            finished_recving={load.req_id for load in meta.loads} or None,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=report,
        )

    def _ack_hits(self, meta):
        from vllm.v1.outputs import KVConnectorOutput

        self.acked["loads"] += len(meta.loads)
        self.acked["load_blocks"] += sum(n for _, n in meta.loads)
        return KVConnectorOutput(finished_recving={r for r, _ in meta.loads} or None)

    def _ack_offloading(self, meta):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        jobs = {jid: self.hosts for jid in meta.load_jobs}
        jobs.update({jid: self.hosts for jid in meta.store_jobs})
        self.acked["saves"] += sum(len(j.src_spec.block_ids) for j in meta.store_jobs.values())
        self.acked["loads"] += len(meta.load_jobs)
        self.acked["load_blocks"] += sum(len(j.dst_spec.block_ids) for j in meta.load_jobs.values())
        return KVConnectorOutput(
            finished_sending=None,
            finished_recving={j.req_id for j in meta.load_jobs.values()} or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=jobs) if jobs else None,
        )

    # ---- one engine step ----
    def step(self, phase: str | None) -> None:
        sched = self.sched
        hooks = self.hook_ns
        h0 = hooks[0] if hooks is not None else 0
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        c0 = cpu()
        t0 = wall()
        so = sched.schedule()
        t1 = wall()
        c1 = cpu()
        mro = self.emulate(so)
        c2 = cpu()
        t2 = wall()
        sched.update_from_output(so, mro)
        t3 = wall()
        c3 = cpu()
        if phase is not None:
            h = hooks[0] - h0 if hooks is not None else 0
            self.times.setdefault(phase, []).append((t1 - t0, t3 - t2, (c1 - c0) + (c3 - c2), h))


def _bench_connectors() -> str:
    """The module name vLLM's connector factory imports tools/bench_connectors.py by (tools/ goes
    on sys.path: this file may be run as a script or loaded by path, as its test does)."""
    tools = os.path.dirname(os.path.abspath(__file__))
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return "bench_connectors"


def build_sims(args, specs, num_blocks: int, max_model_len: int) -> list[Sim]:
    from tpuoffload.manager.topology import host_chunk_bytes
    from tpuoffload.sim.vllm_setup import make_kv_cache_config, make_scheduler

    # One block of every layer: vLLM's page covers the whole mesh; each of the --hosts workers
    # (one per rank with vLLM's default executor) holds its share.
    page_bytes = host_chunk_bytes(make_kv_cache_config(1, args.block_size), 1)
    chunk_bytes = host_chunk_bytes(make_kv_cache_config(1, args.block_size), args.hosts)
    sims = []
    for name, kind, cpu_chunks, fill, *on in specs:
        events = bool(on and on[0])
        common = {"num_blocks": num_blocks, "block_size": args.block_size, "max_num_seqs": args.requests,
                  "max_num_batched_tokens": args.max_batched_tokens, "max_model_len": max_model_len,
                  "tensor_parallel_size": args.hosts, "kv_events": _kv_events(len(sims)) if events else None}
        if kind == "none":
            sched = make_scheduler(connector_module_path=None, connector_class="", **common)
        elif kind in ("null", "hits"):
            cls = "NullConnector" if kind == "null" else "SameHitsConnector"
            sched = make_scheduler(connector_module_path=_bench_connectors(), connector_class=cls, **common)
        elif kind == "offloading":
            # CPUOffloadingSpec: cpu_bytes_to_use is the total over all workers (each chunk holds
            # every worker's shard); one block per chunk (blocks_per_chunk=1, the default) like
            # TPUOffloadConnector; prompt-only (offload_prompt_only=True, the default) likewise.
            sched = make_scheduler(
                connector_module_path=None, connector_class="OffloadingConnector",
                kv_connector_extra_config={"cpu_bytes_to_use": cpu_chunks * page_bytes,
                                           "eviction_policy": "lru"},
                **common)
        else:
            # Staging is raised above one full step of saves so that, like OffloadingConnector,
            # every prompt block is saved (the default, 256 chunks, would skip part of a prefill
            # step's saves and so do less work).
            staging = max(256, 2 * args.max_batched_tokens // args.block_size)
            sched = make_scheduler(
                kv_connector_extra_config={"cpu_bytes_to_use": cpu_chunks * chunk_bytes,
                                           "num_staging_blocks": staging},
                **common)
        sims.append(Sim(name=name, kind=kind, sched=sched, hosts=args.hosts, fill=fill, events=events))
    return sims


def _kv_events(n: int) -> dict:
    """vLLM's --kv-events-config for config number ``n``: its ZMQ publisher bound on an ipc socket
    of its own (no subscriber: each batch is still encoded and sent, on the publisher's thread)."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="bench-kv-events-"), f"pub{n}")
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{path}"}


def count_events(sim: Sim) -> None:
    """Count what the connector's take_events returns (into ``sim.acked``)."""
    conn = sim.sched.connector
    orig = conn.take_events

    def take_events():
        out = list(orig())
        sim.acked["events"] += len(out)
        sim.acked["event_blocks"] += sum(len(getattr(e, "block_hashes", ())) for e in out)
        return out

    conn.take_events = take_events


# Every connector method vLLM's Scheduler calls from schedule() / update_from_output().
# (on_new_request runs in add_request, outside the timed calls, for both connectors.)
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups", "take_events",
    "get_kv_connector_stats", "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids",
    "has_pending_block_frees", "has_pending_push_work", "register_finished_partial_tail",
)


def install_hook_timers(sim: Sim) -> None:
    """Wrap the connector's scheduler-side hooks with timers (perf_counter_ns: about 0.1 us per
    call; thread_time_ns, a system call on some VMs, cost 0.6 us per call on the 2-core machine, a
    few µs cold, and with two per hook call it inflated both connectors' hook time by tens of µs per
    step). The timed phases run with the collector off, so the wall time inside a hook is its CPU
    time unless the process is descheduled; medians per step discard such steps. take_events is
    drained inside the timer (it may be a generator)."""
    conn = sim.sched.connector
    acc = [0]
    busy = [False]
    for name in SCHEDULER_HOOKS:
        orig = getattr(conn, name, None)
        if orig is None:
            continue

        def wrapped(*a, _orig=orig, _drain=name == "take_events", **k):
            if busy[0]:  # a hook calling another hook: count once
                return _orig(*a, **k)
            busy[0] = True
            t = time.perf_counter_ns()
            try:
                out = _orig(*a, **k)
                return list(out) if _drain else out
            finally:
                acc[0] += time.perf_counter_ns() - t
                busy[0] = False

        setattr(conn, name, wrapped)
    sim.hook_ns = acc


def capacity(sim: Sim) -> int:
    if sim.kind == "tpu":
        return sim.sched.connector.scheduler.index.num_slots
    if sim.kind == "offloading":
        return sim.sched.connector.scheduler.manager._num_chunks
    return 0


def held(sim: Sim) -> str:
    if sim.kind == "tpu":
        s = sim.sched.connector.scheduler
        return f"{len(s.index)} chunks held, {s.index.num_saving()} saving, ledger {len(s.ledger)}"
    if sim.kind == "offloading":
        s = sim.sched.connector.scheduler
        m = s.manager
        return f"{m._num_allocated_chunks - len(m._free_list)} chunks held, {len(s._jobs)} jobs pending"
    return "-"


def prefill_index(sim: Sim, n: int, seed: int) -> float:
    """Fill TPUOffloadConnector's host index with n READY chunks of random hashes, through the
    scheduler half's own index and ledger (allocate, register, every host confirms, mark READY)."""
    from tpuoffload.manager.hash_table import HashKeys

    sched = sim.sched.connector.scheduler
    index, ledger = sched.index, sched.ledger
    rnd = random.Random(seed)
    t = time.perf_counter()
    batch = 65536
    done = 0
    gc.disable()  # millions of new objects: repeated full collections would make this slow
    try:
        while done < n:
            k = min(batch, n - done)
            slots = index.allocate(k)
            base = ledger.open_batch(slots, float("inf"), step=-1)
            index.add_saving(HashKeys.of([rnd.randbytes(32) for _ in range(k)]), slots, base)
            for h in range(ledger.num_hosts):
                ledger.report(h, ok=[(base, base + k)])
            res = ledger.take_resolved()
            index.mark_ready(res.ready_slots, res.ready_ids)
            done += k
    finally:
        gc.enable()
    assert len(index) == n, (len(index), n)
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------- workload
class Workload:
    def __init__(self, args):
        self.args = args
        rnd = random.Random(args.seed)
        R, P, bs = args.requests, args.prompt_len, args.block_size

        def fresh(n):
            return [rnd.randrange(10, 31000) for _ in range(n)]

        self.wave0 = [fresh(P) for _ in range(R)]
        shared = (P // 2) // bs * bs
        n_hit = round(R * args.hit_fraction)
        self.hit_waves = [[self.wave0[i][:shared] + fresh(P - shared) if i < n_hit else fresh(P) for i in range(R)]
                          for _ in range(args.rounds)]
        self.cold_waves = [[fresh(P) for _ in range(R)] for _ in range(args.rounds)]
        self.ramp_waves = [[fresh(P) for _ in range(R)] for _ in range(args.rounds)]  # the last one decodes
        prefill_steps = -(-R * P // args.max_batched_tokens) + 8
        self.decode_tokens = prefill_steps + args.warmup + args.steps + 16
        self.max_model_len = P + self.decode_tokens + bs
        if self.max_model_len > 8192:
            raise SystemExit(f"prompt + decode = {self.max_model_len} tokens exceeds the tiny model's 8192")
        self.num_blocks = R * (-(-self.max_model_len // bs)) + 4 * R + 16

    def max_saved_chunks(self) -> int:
        """At most the prompt blocks of every wave (each prompt block is saved at most once)."""
        waves = [self.wave0, *self.hit_waves, *self.cold_waves, *self.ramp_waves]
        return sum(len(p) // self.args.block_size for wave in waves for p in wave)


def add_wave(sim: Sim, prompts, tag: str, max_tokens: int) -> None:
    from tpuoffload.sim.vllm_setup import make_request

    sim.wave = []
    for i, p in enumerate(prompts):
        req = make_request(f"{tag}-{i}", p, max_tokens=max_tokens, block_size=sim.sched.block_size)
        sim.sched.add_request(req)
        sim.wave.append(req)


def reset_prefix_cache(sim: Sim) -> None:
    assert not sim.sched.has_requests(), f"{sim.name}: requests left"
    ok = sim.sched.reset_prefix_cache()
    assert ok, f"{sim.name}: prefix cache reset failed"


def round_robin(sims, phase, done, max_steps=100_000, steps_per_turn=1) -> None:
    """Step every sim until done(sim); timing recorded under ``phase`` (None: untimed). The sims
    take turns, ``steps_per_turn`` steps each, in an order shuffled every round (seeded), so drift
    in machine speed hits every config alike (a fixed order would also always put the same config
    after the heaviest one, OffloadingConnector, and the baseline after the lightest).

    With one step per turn every step runs on the caches another config's step left. With more,
    all but the first step of a turn follow the same scheduler's previous step, as in a serving
    engine (one scheduler per engine process); the medians are then those steps'."""
    active = list(sims)
    rng = random.Random(len(sims))
    n = 0
    while active:
        order = list(active)
        rng.shuffle(order)
        for sim in order:
            for _ in range(steps_per_turn):
                if done(sim):
                    active.remove(sim)
                    break
                sim.step(phase)
        n += 1
        if n > max_steps:
            raise RuntimeError(f"phase {phase}: not done after {max_steps} rounds")


class gc_window:
    def __init__(self, mode: str):
        self.mode = mode

    def __enter__(self):
        gc.collect()
        if self.mode == "off":
            gc.disable()

    def __exit__(self, *exc):
        gc.enable()


def all_finished(sim: Sim) -> bool:
    return not sim.sched.has_requests()


def all_sampled(sim: Sim) -> bool:
    return all(r.num_output_tokens >= 1 for r in sim.wave)


def run_wave(sims, prompts, tag, max_tokens, phase, done, args) -> None:
    for s in sims:
        add_wave(s, prompts, tag, max_tokens)
    with gc_window(args.gc):
        round_robin(sims, phase, done, steps_per_turn=args.steps_per_turn)


def run_workload(sims, wl: Workload, args, log) -> None:
    R = args.requests
    t = time.perf_counter()
    run_wave(sims, wl.wave0, "w0", 2, None, all_finished, args)
    log(f"  wave 0 (warm-up, fills host RAM) done in {time.perf_counter() - t:.1f}s")

    t = time.perf_counter()
    for k in range(args.rounds):
        for s in sims:
            reset_prefix_cache(s)  # host RAM keeps its chunks; vLLM's own prefix cache forgets
        run_wave(sims, wl.hit_waves[k], f"h{k}", 2, "prefill+hits", all_finished, args)
        for s in sims:
            reset_prefix_cache(s)
        run_wave(sims, wl.cold_waves[k], f"c{k}", 2, "prefill cold", all_finished, args)
    log(f"  {args.rounds} round(s) of prefill waves done in {time.perf_counter() - t:.1f}s")

    t = time.perf_counter()
    for k, prompts in enumerate(wl.ramp_waves):
        for s in sims:
            reset_prefix_cache(s)
        run_wave(sims, prompts, f"r{k}", wl.decode_tokens, "ramp", all_sampled, args)
        if k < len(wl.ramp_waves) - 1:  # another ramp follows: this wave's requests are aborted
            from vllm.v1.request import RequestStatus

            for s in sims:
                s.sched.finish_requests([r.request_id for r in s.wave], RequestStatus.FINISHED_ABORTED)
            round_robin(sims, None, all_finished)
    for s in sims:
        assert len(s.sched.running) == R, (s.name, len(s.sched.running))
        s.counter = 0
    round_robin(sims, None, lambda s: _count(s, args.warmup), steps_per_turn=args.steps_per_turn)
    for s in sims:
        s.counter = 0
    with gc_window(args.gc):
        round_robin(sims, "decode", lambda s: _count(s, args.steps), steps_per_turn=args.steps_per_turn)
    for s in sims:
        assert len(s.sched.running) == R and not s.sched.waiting, (s.name, len(s.sched.running))
        assert all(not r.is_finished() for r in s.wave), s.name
    log(f"  ramp + decode done in {time.perf_counter() - t:.1f}s")


def _count(sim: Sim, n: int) -> bool:
    """Done after n steps since sim.counter was reset."""
    if sim.counter >= n:
        return True
    sim.counter += 1
    return False


# ---------------------------------------------------------------------------------------- report
PHASES = ("decode", "ramp", "prefill cold", "prefill+hits")
PHASE_NOTES = {
    "decode": "every request running, one token each per step (the steady state)",
    "ramp": "fresh prompts admitted into an empty engine until every one sampled its first token",
    "prefill cold": "fresh prompts, 2 output tokens each, until all finished: every prompt block saved, lookups miss",
    "prefill+hits": "half the prompts' first half is in host RAM only: lookups hit, loads; (a) recomputes instead",
}


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(sim: Sim, phase: str):
    rec = sim.times.get(phase, [])
    nan = float("nan")
    wall = [(a + b) / 1000 for a, b, _, _ in rec]
    cpu = [c / 1000 for _, _, c, _ in rec]
    hook = [h / 1000 for _, _, _, h in rec]

    def stats(xs):
        if not xs:
            return {"med": nan, "p90": nan, "mean": nan}
        return {"med": statistics.median(xs), "p90": pct(xs, 0.9), "mean": statistics.fmean(xs)}

    return {"n": len(rec), "wall": stats(wall), "cpu": stats(cpu), "hook": stats(hook)}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1%}" if b > 0 else "n/a"


def print_per_request(sims, phase: str, requests: int, base_name: str, out=print) -> None:
    """The whole phase's CPU time per request, added over ``base_name``: in "prefill+hits" the
    connectors load prefixes that (a) recomputes, so they run fewer, fuller steps and a per-step
    figure charges them for vLLM's work on the extra requests each step carries."""
    tot = {s.name: sum(c for _, _, c, _ in s.times.get(phase, [])) / 1000 / requests for s in sims}
    base = tot[base_name]
    parts = [f"{name} {v - base:+.0f}" for name, v in tot.items() if name != base_name]
    out(f"{'':<13} whole phase, CPU time per request: {base_name} {base:.0f} us; added: " + ", ".join(parts))


def print_table(sims, phases, base_name, ratio_pair=None, net_of=None, out=print) -> None:
    """Per phase and config: step time, and what it adds over ``base_name``; for ``ratio_pair``
    (num, den) the ratio of what they add, also net of config ``net_of`` (CPU medians)."""
    hdr = (f"{'phase':<13} {'config':<24} {'steps':>5} | {'median':>7} {'p90':>7} {'mean':>7} | "
           f"{'median':>7} {'p90':>7} | {'added':>7} {'added':>7} {'added':>7}")
    out(f"{'':<13} {'':<24} {'':>5} | {'wall clock (perf_counter)':^23} | {'CPU time':^15} | "
        f"{'wall':>7} {'wall':>7} {'CPU':>7}")
    out(hdr[:-24] + f"{'median':>7} {'mean':>7} {'median':>7}")
    out("-" * len(hdr))
    for phase in phases:
        st = {s.name: summarize(s, phase) for s in sims}
        base = st[base_name]
        for s in sims:
            x = st[s.name]
            w, c = x["wall"], x["cpu"]
            if s.name == base_name:
                added = f"{'-':>7} {'-':>7} {'-':>7}"
            else:
                added = (f"{w['med'] - base['wall']['med']:+7.0f} {w['mean'] - base['wall']['mean']:+7.0f} "
                         f"{c['med'] - base['cpu']['med']:+7.0f}")
            out(f"{phase:<13} {s.name:<24} {x['n']:>5} | {w['med']:>7.0f} {w['p90']:>7.0f} {w['mean']:>7.0f} | "
                f"{c['med']:>7.0f} {c['p90']:>7.0f} | {added}")
        if ratio_pair is not None:
            num, den = (st[n] for n in ratio_pair)
            r = [_ratio(num[k][m] - base[k][m], den[k][m] - base[k][m])
                 for k, m in (("wall", "med"), ("wall", "mean"), ("cpu", "med"))]
            out(f"{'':<13} added cost (c) / (b): wall median {r[0]}, wall mean {r[1]}, CPU median {r[2]}")
            if net_of is not None:  # its steps without the time inside its own hooks: vLLM's part
                ref = st[net_of]["cpu"]["med"] - st[net_of]["hook"]["med"]
                a, b = num["cpu"]["med"] - ref, den["cpu"]["med"] - ref
                out(f"{'':<13} net of vLLM's own work in {net_of} (its CPU median less its hooks' "
                    f"{st[net_of]['hook']['med']:.0f} us): (c) adds {a:+.0f} us, (b) {b:+.0f} us, (c) / (b) {_ratio(a, b)}")
        out("")


def print_hook_table(sims, phases, ratio_pair, out=print) -> None:
    hdr = f"{'phase':<13} {'config':<24} {'steps':>5} | {'median':>7} {'p90':>7} {'mean':>7}"
    out(hdr)
    out("-" * len(hdr))
    for phase in phases:
        st = {s.name: summarize(s, phase) for s in sims}
        for s in sims:
            h = st[s.name]["hook"]
            out(f"{phase:<13} {s.name:<24} {st[s.name]['n']:>5} | {h['med']:>7.0f} {h['p90']:>7.0f} {h['mean']:>7.0f}")
        num, den = (st[n]["hook"] for n in ratio_pair)
        out(f"{'':<13} hook time (c) / (b): median {_ratio(num['med'], den['med'])}, "
            f"mean {_ratio(num['mean'], den['mean'])}")
        out("")


def print_work(sims, out=print) -> None:
    for s in sims:
        if s.kind in ("none", "null"):
            continue
        if s.kind == "hits":
            out(f"  {s.name:<24} loads {s.acked['loads']} ({s.acked['load_blocks']} blocks)")
            continue
        out(f"  {s.name:<24} saved blocks {s.acked['saves']}, loads {s.acked['loads']} "
            f"({s.acked['load_blocks']} blocks); end state: {held(s)}")
        if s.acked["meta_steps"]:
            out(f"  {'':<24} per-step metadata of steps with saves: {s.acked['meta_bytes'] / s.acked['meta_steps']:.0f} "
                f"bytes pickled on average, {s.acked['meta_bytes'] / s.acked['saves']:.1f} bytes per saved chunk")


# ---------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    import logging

    import tpuoffload.sim.vllm_setup  # noqa: F401  (sets VLLM_TARGET_DEVICE before vllm is imported)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("tpuoffload").setLevel(logging.WARNING)

    wl = Workload(args)
    if args.events:
        return measure_events(args, wl, log, t_start)
    log(f"workload: {args.requests} requests x {args.prompt_len}-token prompts, block {args.block_size}, "
        f"max_num_batched_tokens {args.max_batched_tokens}, {args.hosts} host(s), {wl.num_blocks} GPU blocks, "
        f"{args.rounds} prefill round(s), decode {args.warmup} warm-up + {args.steps} timed steps, "
        f"gc {args.gc} in timed phases, {args.steps_per_turn} step(s) per turn")
    main_specs = [("(a) none", "none", 0, 0),
                  ("(b) OffloadingConnector", "offloading", args.cpu_chunks, 0),
                  ("(c) TPUOffloadConnector", "tpu", args.cpu_chunks, 0),
                  ("(d) null connector", "null", 0, 0),
                  ("(e) same hits", "hits", 0, 0)]
    ratio = ("(c) TPUOffloadConnector", "(b) OffloadingConnector")

    # ---- measurement 1: none vs OffloadingConnector vs TPUOffloadConnector ----
    log("measurement 1: building schedulers")
    sims = build_sims(args, main_specs, wl.num_blocks, wl.max_model_len)
    install_hook_timers(sims[4])  # (e)'s own hook time is taken out of its steps below
    prof = _install_profiler(sims[2]) if args.profile else None
    run_workload(sims, wl, args, log)
    if prof is not None:
        prof.dump_stats(args.profile)
        log(f"  cProfile of TPUOffloadConnector hooks written to {args.profile}")

    print()
    print("=" * 100)
    print("1. Scheduler-side cost per engine step, in microseconds: schedule() + update_from_output(),")
    print(f"   {args.requests} requests, {args.prompt_len}-token prompts, block {args.block_size}, "
          f"max_num_batched_tokens {args.max_batched_tokens}, {args.hosts} host(s), gc {args.gc} in timed phases,")
    print(f"   configs take turns of {args.steps_per_turn} step(s) (--steps-per-turn)")
    print(f"   host RAM: (b) {capacity(sims[1])} chunks, (c) {capacity(sims[2])} chunks; "
          f"'added' = config minus (a) no connector")
    print("=" * 100)
    for ph in PHASES:
        print(f"  {ph:<13} {PHASE_NOTES[ph]}")
    print()
    print_table(sims, PHASES, "(a) none", ratio_pair=ratio, net_of="(e) same hits")
    for ph in ("prefill cold", "prefill+hits"):
        print_per_request(sims, ph, args.requests * args.rounds, "(a) none")
    print()
    print("work acknowledged by the fake worker (the two connectors must match):")
    print_work(sims)
    print()
    sys.stdout.flush()
    del sims, prof
    gc.collect()

    # ---- measurement 1b: time inside the connector hooks only ----
    if args.hooks:
        log("measurement 1b: same workload, connector hooks timed")
        sims = build_sims(args, main_specs, wl.num_blocks, wl.max_model_len)
        for s in sims[1:]:
            install_hook_timers(s)
        run_workload(sims, wl, args, log)
        print("=" * 100)
        print("1b. Time inside the connector's scheduler-side hooks per step, in microseconds (a second run")
        print("    with every hook wrapped in a perf_counter timer, ~0.2 us per call counted in). It leaves out vLLM's own")
        print("    per-connector work, so it is a lower bound of the added cost, but not a difference of noisy totals")
        print("=" * 100)
        print_hook_table(sims[1:], PHASES, ratio)
        sys.stdout.flush()
        del sims
        gc.collect()

    # ---- measurement 2: TPUOffloadConnector with N chunks already held ----
    if args.fill_list:
        max_fill = max(args.fill_list)
        # Room for every chunk the workload saves: no eviction, except in the "full" config, whose
        # capacity is exactly the fill, so that every save evicts an LRU chunk.
        slots = max_fill + wl.max_saved_chunks() + 1024
        log(f"measurement 2: building schedulers (index capacity {slots} chunks, fills {args.fill_list})")
        specs = [("(a) none", "none", 0, 0)]
        specs += [(f"(c) {n} held", "tpu", slots, n) for n in args.fill_list]
        if max_fill > 0:
            specs.append((f"(c) {max_fill} held, full", "tpu", max_fill, max_fill))
        sims2 = build_sims(args, specs, wl.num_blocks, wl.max_model_len)
        for s in sims2:
            if s.kind == "tpu" and s.fill:
                dt = prefill_index(s, s.fill, seed=args.seed + s.fill)
                log(f"  {s.name}: filled {s.fill} READY chunks in {dt:.1f}s")
        gc.collect()
        run_workload(sims2, wl, args, log)
        print("=" * 100)
        print("2. TPUOffloadConnector vs READY chunks already held in its host index (random hashes, never")
        print(f"   hit). Capacity {slots} chunks (room for everything saved: no eviction), except")
        print(f"   '{max_fill} held, full': capacity {max_fill}, so every save first evicts an LRU chunk")
        print("=" * 100)
        print_table(sims2, PHASES, "(a) none")
        print_work(sims2)
        print()
    log(f"total wall time {time.perf_counter() - t_start:.0f}s")
    return 0


def measure_events(args, wl: Workload, log, t_start: float) -> int:
    """Measurement 3: KV events off and on, side by side."""
    log("measurement 3: building schedulers (KV events off and on)")
    specs = [("(a) none", "none", 0, 0), ("(a) none, events", "none", 0, 0, True),
             ("(c) tpuoffload", "tpu", args.cpu_chunks, 0),
             ("(c) tpuoffload, events", "tpu", args.cpu_chunks, 0, True)]
    sims = build_sims(args, specs, wl.num_blocks, wl.max_model_len)
    count_events(sims[3])
    for s in sims[2:]:
        install_hook_timers(s)
    run_workload(sims, wl, args, log)
    print()
    print("=" * 100)
    print("3. KV events off and on: scheduler-side cost per engine step, in microseconds: schedule() +")
    print(f"   update_from_output(), {args.requests} requests, {args.prompt_len}-token prompts, block {args.block_size}, "
          f"{args.hosts} host(s), gc {args.gc} in timed phases;")
    print("   'events on' = vLLM's --kv-events-config with its ZMQ publisher (ipc); the (c) configs' hooks are timed")
    print("=" * 100)
    print_table(sims, PHASES, "(a) none")
    print(f"{'phase':<13} | {'vLLM HBM events':>15} {'tpuoffload events':>17} | "
          f"{'(c) hooks off':>13} {'(c) hooks on':>12} {'hooks added':>11}   (CPU medians per step, us)")
    for ph in PHASES:
        st = {s.name: summarize(s, ph) for s in sims}
        a0, a1, c0, c1 = (st[s.name] for s in sims)
        vllm_ev = a1["cpu"]["med"] - a0["cpu"]["med"]
        ours = (c1["cpu"]["med"] - c0["cpu"]["med"]) - vllm_ev
        h0, h1 = c0["hook"]["med"], c1["hook"]["med"]
        print(f"{ph:<13} | {vllm_ev:>+15.1f} {ours:>+17.1f} | {h0:>13.1f} {h1:>12.1f} {h1 - h0:>+11.1f}")
    print()
    ev = sims[3].acked
    print(f"  (c) tpuoffload, events: {ev['events']} events taken from it, {ev['event_blocks']} block hashes in them")
    print_work(sims)
    print()
    log(f"total wall time {time.perf_counter() - t_start:.0f}s")
    return 0


def _install_profiler(sim: Sim):
    """cProfile only inside TPUOffloadConnector's scheduler-side hooks (adds overhead to (c))."""
    import cProfile

    prof = cProfile.Profile()
    conn = sim.sched.connector
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished", "get_kv_connector_stats"):
        orig = getattr(conn, name)

        def wrapped(*a, _orig=orig, **k):
            prof.enable()
            try:
                return _orig(*a, **k)
            finally:
                prof.disable()

        setattr(conn, name, wrapped)
    return prof


if __name__ == "__main__":
    sys.exit(main())
