"""A simulated pod slice: one scheduler process and N JAX worker processes on this machine.

The workers are joined by ``jax.distributed`` (CPU devices, gloo collectives) into one mesh whose
heads axis spans every process, so each worker holds only its own heads of every block, as a host
of a TPU pod slice does. Every step the scheduler sends the same SchedulerOutput to every worker,
merges their outputs with vLLM's KVOutputAggregator, and compares, across hosts, the per-host
dispatch digests and the sampled tokens; the first divergence stops the run with each host's op
list (DigestMismatch).

No run can hang and no process outlives the slice:

* every send and every receive has a deadline (``SliceSpec.step_timeout_s`` per step); all hosts
  are awaited together, so a host that dies is noticed at once (its pipe closes), not after the
  others time out waiting for it in a collective;
* every worker runs in its own process group; ``close`` (also run when the constructor fails, on
  ``__exit__`` and at interpreter exit) SIGKILLs each group and reaps it;
* a worker whose parent disappears (its stdin closes, or it is re-parented) exits by itself;
* each host's stderr goes to ``<log_dir>/host<i>.log`` (a temp dir unless given), and every
  SliceError ends with the last lines of the logs of the hosts concerned.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import select
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from tpuoffload import counters as C
from tpuoffload.manager.offload_scheduler import leaks_in
from tpuoffload.sim.engine import absorb_outputs
from tpuoffload.snapshot import read_rank_snapshots
from tpuoffload.sim.hybrid_layouts import HYBRID_LAYOUTS, HybridLayoutSpec
from tpuoffload.sim.hybrid_layouts import kv_cache_config as hybrid_kv_cache_config
from tpuoffload.sim.tpu_layouts import LAYOUTS, TpuLayoutSpec, kv_cache_spec, sharding_config
from tpuoffload.sim.chaos import Chaos, PointFaults
from tpuoffload.sim.dispatch_marks import misplaced_op
from tpuoffload.sim.launch import WorkerProcess, start_worker
from tpuoffload.sim.frames import HEAD, HostPipe, free_port


class SliceError(RuntimeError):
    """The slice stopped: a worker died, timed out, raised, or the hosts diverged."""


class DigestMismatch(SliceError):
    """The hosts dispatched different JAX work (or sampled different tokens) in the same step."""


class MisplacedDispatch(DigestMismatch):
    """A host dispatched JAX work outside the connector hooks that may dispatch (bind, start_load,
    wait_for_save): from a background thread, or during the forward. Even when every host happens
    to do it at the same moment (so the digests agree), the order is a matter of timing."""


@dataclass
class SliceSpec:
    """A pod slice of ``num_hosts`` processes x ``devices_per_host`` CPU devices, holding the KV
    cache tpu-inference allocates for a tensor-parallel model over all of them (``slice_layout``),
    or the named deployment ``layout`` from ``tpuoffload.sim.tpu_layouts.LAYOUTS``."""

    num_hosts: int = 2
    devices_per_host: int = 2
    num_blocks: int = 96
    block_size: int = 16
    num_layers: int = 2
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    layout: str | None = None
    # A hybrid model (vLLM's hybrid KV cache manager on) by name in
    # ``tpuoffload.sim.hybrid_layouts.HYBRID_LAYOUTS``, with ``kv_budget_bytes`` of KV memory for
    # vLLM's block count: tpu-inference's arrays over every host's devices (``layout`` ignored).
    hybrid: str | None = None
    kv_budget_bytes: int = 0
    # A GDN (Qwen3.5-like) hybrid by name in ``tpuoffload.sim.gdn_layout.GDN_LAYOUTS``: the driver
    # and every host build it with tpu-inference's and vLLM's own code (sim/gdn_layout.py; the
    # hosts over the slice's mesh), the hosts run a GdnRunner (``layout``, ``hybrid``, ``num_blocks``
    # and ``block_size`` ignored; ``max_num_seqs``, ``max_num_batched_tokens`` apply).
    gdn: str | None = None
    max_model_len: int = 0  # hybrid: 0 keeps the layout's
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    extra_config: dict[str, Any] = field(default_factory=lambda: {"cpu_bytes_to_use": 1 << 22})
    # vLLM's --kv-events-config (KVEventsConfig fields) for the slice's scheduler (any layout):
    # under DPScheduler every rank process builds its own publisher from it.
    kv_events: dict[str, Any] | None = None
    step_timeout_s: float = 60.0  # one step (or one control message), all hosts together
    start_timeout_s: float = 120.0
    log_tail_lines: int = 25  # lines of each concerned host's log quoted in a SliceError


    def hybrid_layout(self) -> HybridLayoutSpec:
        hybrid = dataclasses.replace(HYBRID_LAYOUTS[self.hybrid], block_size=self.block_size)
        if self.max_model_len:
            hybrid = dataclasses.replace(hybrid, max_model_len=self.max_model_len)
        if hybrid.num_devices != self.num_hosts * self.devices_per_host:
            raise ValueError(f"layout {hybrid.name} needs {hybrid.num_devices} devices; the slice has "
                             f"{self.num_hosts} hosts x {self.devices_per_host}")
        return hybrid

    def gdn_layout(self):
        from tpuoffload.sim.gdn_layout import GDN_LAYOUTS

        gdn = dataclasses.replace(GDN_LAYOUTS[self.gdn], block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                                  max_num_batched_tokens=self.max_num_batched_tokens,
                                  **({"max_model_len": self.max_model_len} if self.max_model_len else {}))
        if gdn.num_devices != self.num_hosts * self.devices_per_host:
            raise ValueError(f"layout {gdn.name} needs {gdn.num_devices} devices; the slice has "
                             f"{self.num_hosts} hosts x {self.devices_per_host}")
        return gdn

    def slice_layout(self) -> TpuLayoutSpec:
        """The whole slice's cache: one mesh over every host's devices."""
        if self.gdn is not None:
            return self.gdn_layout().tpu_spec()
        if self.hybrid is not None:
            return self.hybrid_layout().tpu_spec()
        if self.layout is not None:
            named = LAYOUTS[self.layout]
            spec = dataclasses.replace(named, num_blocks=self.num_blocks, block_size=self.block_size)
        else:
            spec = TpuLayoutSpec(f"slice-{self.num_kv_heads}kv-tp{self.num_hosts * self.devices_per_host}",
                                 num_layers=self.num_layers, num_blocks=self.num_blocks, block_size=self.block_size,
                                 num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                                 tp=self.num_hosts * self.devices_per_host)
        if spec.num_devices != self.num_hosts * self.devices_per_host:
            raise ValueError(f"layout {spec.name} needs {spec.num_devices} devices; the slice has "
                             f"{self.num_hosts} hosts x {self.devices_per_host}")
        return spec

    def host_layout(self) -> TpuLayoutSpec:
        """One host's part of the slice as a cache of its own (for slices simulated in one process):
        the same per-host shape and bytes, on ``devices_per_host`` devices."""
        whole = self.slice_layout()
        if self.num_hosts == 1:
            return whole
        if whole.dp != 1 or whole.attn_dp != 1 or whole.dcp != 1 or whole.num_kv_heads % self.num_hosts:
            raise ValueError(f"{whole.name} cannot be split into per-host tensor-parallel caches")
        return dataclasses.replace(whole, name=f"{whole.name}-host", num_kv_heads=whole.num_kv_heads // self.num_hosts,
                                   tp=self.devices_per_host)


def _kill_processes(procs) -> None:
    """SIGKILL and reap multiprocessing children (DPScheduler's rank processes, which hold both ends
    of their command pipes and would block forever once the engine is gone)."""
    for proc in procs:
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in procs:
        proc.join(timeout=10)


def _kill_groups(procs: Iterable[WorkerProcess]) -> None:
    procs = list(procs)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass



def _is_error(reply: Any) -> bool:
    """A worker's reply to an exchange that says it raised: ``("error", traceback)``."""
    return isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "error"

class PodSlice:
    """Start with ``PodSlice(spec, chaos)``; use as a context manager so the workers always die.

    After every step: ``steps``, ``digests`` (per step, per host), ``outputs``/``finished`` (per
    request), ``aborted`` (requests aborted by chaos or ``abort``), ``stats`` (an OffloadStats: the
    union of every stats report that reached vLLM's stats path, scheduler and all hosts),
    ``mismatches`` (per host: context positions whose KV was wrong, so far: every wrong read counts,
    since no forward ever reads a block whose load failed), ``preemptions``.
    """

    def __init__(self, spec: SliceSpec, chaos: Chaos | None = None, log_dir: str | None = None, *,
                 point_faults: PointFaults | None = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        from tpuoffload.sim.vllm_setup import is_dp_scheduler, make_scheduler
        from tpuoffload.stats import OffloadStats

        self.spec = spec
        self.chaos = chaos or Chaos()
        self.point_faults = point_faults
        self._rng = random.Random(self.chaos.seed)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="podslice-")
        os.makedirs(self.log_dir, exist_ok=True)
        sharding = sharding_config(spec.slice_layout())
        extra = dict(spec.extra_config)
        if sharding.total_dp_size > 1 and "stats_dir" not in extra:
            # DPScheduler's rank schedulers live in forked processes: their halves are read back
            # through their snapshot files (scheduler-dp<rank>.json), one per step.
            extra.update(stats_dir=os.path.join(self.log_dir, "stats"), stats_interval_s=0)
        self.stats_dir = extra.get("stats_dir")
        if self.stats_dir and os.path.isdir(self.stats_dir):  # a reused log dir: no earlier run's files
            for name in os.listdir(self.stats_dir):
                if name.endswith(".json"):
                    os.remove(os.path.join(self.stats_dir, name))
        common = dict(kv_connector_extra_config=extra, max_num_seqs=spec.max_num_seqs,
                      max_num_batched_tokens=spec.max_num_batched_tokens, tensor_parallel_size=spec.num_hosts,
                      sharding_config=sharding, kv_events=spec.kv_events)
        if spec.gdn is not None:
            self.scheduler = self._gdn_scheduler(extra)
        elif spec.hybrid is not None:
            hybrid = spec.hybrid_layout()
            cfg = hybrid_kv_cache_config(hybrid, spec.kv_budget_bytes, hma=True)
            self.scheduler = make_scheduler(num_blocks=cfg.num_blocks, block_size=hybrid.block_size,
                                            kv_cache_config=cfg, max_model_len=hybrid.max_model_len, **common)
        else:
            self.scheduler = make_scheduler(
                num_blocks=spec.num_blocks, block_size=spec.block_size,
                # What tpu-inference's runner reports (MLAAttentionSpec for MLA, its page of the whole
                # mesh), grouped as vLLM's engine core groups it.
                kv_cache_spec=kv_cache_spec(spec.slice_layout()), **common)
        #: tpu-inference's DPScheduler runs the scheduler (total_dp_size > 1): one vLLM scheduler
        #: and one tpuoffload scheduler half per DP rank, each in a forked process.
        self.dp_ranks = sharding.total_dp_size if is_dp_scheduler(self.scheduler) else 1
        self.aggregator = (KVOutputAggregator(spec.num_hosts) if self.dp_ranks > 1
                           else KVOutputAggregator.from_connector(self.scheduler.connector, spec.num_hosts))
        self.procs: list[WorkerProcess] = []  # kept after close, so callers can check they are gone
        self._pipes: list[HostPipe] = []
        self.steps = 0
        self.digests: list[list[str]] = []  # per step, per host
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.stats = OffloadStats()
        self.mismatches: list[int] = [0] * spec.num_hosts
        self.first_mismatch_step: int | None = None
        self.vllm_preemptions = 0  # SchedulerOutput.preempted_req_ids, all steps (0 under DPScheduler: see preemptions)
        self.final: list[dict] = []
        self.start_state: list[dict] = []
        self.closed = False
        self._failed: str | None = None  # the first failed exchange
        self._finalizer = weakref.finalize(self, _kill_groups, self.procs)
        self._rank_finalizer = weakref.finalize(self, _kill_processes, list(getattr(self.scheduler, "processes", ())))
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _gdn_scheduler(self, extra: dict):
        """The GDN layout's scheduler, built from the layout on this process's own devices (the
        sizes are the slice's: every host builds the same one): vLLM's with tpu-inference's hybrid
        coordinator, or tpu-inference's DPScheduler under data parallelism."""
        import jax

        from tpuoffload.sim import gdn_layout as gl

        gdn = self.spec.gdn_layout()
        self.gdn = gl.build(gdn, jax.devices()[:gdn.num_devices])  # requests are built from it (gl.make_request)
        vllm_config = gl.make_vllm_config(gdn, dict(extra, num_hosts=self.spec.num_hosts))
        if self.spec.kv_events is not None:  # what --kv-events-config parses into
            from vllm.config.kv_events import KVEventsConfig

            vllm_config.kv_events_config = KVEventsConfig(**self.spec.kv_events)
        if gdn.dp > 1:
            return gl.make_dp_scheduler(self.gdn, vllm_config)
        return gl.make_scheduler(self.gdn, vllm_config=vllm_config)[0]

    @property
    def offload(self):
        """The scheduler half (one vLLM scheduler only; under DPScheduler see ``leak_reports``)."""
        if self.dp_ranks > 1:
            raise AttributeError("under DPScheduler the scheduler halves live in the rank processes")
        return self.scheduler.connector.scheduler

    def leak_reports(self) -> list[dict]:
        """Every scheduler half's ``leak_report``: the one half, or each DP rank's, read from the
        snapshot its rank process wrote at its last step."""
        if self.dp_ranks == 1:
            return [self.offload.leak_report()]
        snaps = read_rank_snapshots(self.stats_dir)
        if len(snaps) != self.dp_ranks:
            raise SliceError(f"expected {self.dp_ranks} rank scheduler snapshots in {self.stats_dir}, found {list(snaps)}")
        return [leaks_in(snap) | {"source": name} for name, snap in snaps.items()]

    def _live_request_ids(self) -> list[str]:
        if self.dp_ranks > 1:  # DPScheduler forgets a finished request one step later
            return sorted(r for r in self.scheduler.assigned_dp_rank if r not in self.finished and r not in self.aborted)
        return sorted(r for r, req in self.scheduler.requests.items() if not req.is_finished())

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"host{rank}.log")

    # ---------------------------------------------------------------- processes
    def _start(self) -> None:
        port = free_port()
        env = dict(os.environ)
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={self.spec.devices_per_host}",
                   HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", PYTHONUNBUFFERED="1")
        init = {"spec": asdict(self.spec), "chaos": asdict(self.chaos),
                "point_faults": asdict(self.point_faults) if self.point_faults else None,
                "vllm_config": self.scheduler.vllm_config, "kv_cache_config": self._kv_cache_config()}
        for rank in range(self.spec.num_hosts):
            proc = start_worker(rank, self.spec.num_hosts, port, env, self.log_path(rank))
            self.procs.append(proc)
            self._pipes.append(HostPipe(proc))
        replies = self._exchange(init, self.spec.start_timeout_s, "start")
        for rank, msg in enumerate(replies):
            if msg != "ready":
                raise self._error(f"host {rank} failed to start: {msg!r}", [rank])
        self.start_state = self.worker_state()

    def _kv_cache_config(self):
        """The engine's KV cache config, as the workers get it (DPScheduler keeps only per-rank copies)."""
        if self.spec.gdn is not None:
            return None  # every host builds the GDN layout, its worker KV cache config with it
        if self.dp_ranks == 1:
            return self.scheduler.kv_cache_config
        whole = dataclasses.replace(self.scheduler.per_rank_kv_cache_configs[0])
        whole.num_blocks = self.spec.num_blocks
        return whole

    def _tail(self, rank: int) -> str:
        try:
            with open(self.log_path(rank), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(lines[-self.spec.log_tail_lines:])

    def _error(self, message: str, ranks: Iterable[int], cls: type[SliceError] = SliceError) -> SliceError:
        parts = [message]
        for rank in sorted(set(ranks)):
            parts.append(f"--- host {rank}: last {self.spec.log_tail_lines} lines of {self.log_path(rank)} ---")
            parts.append(self._tail(rank))
        return cls("\n".join(parts))

    def _exit_status(self, rank: int) -> str:
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "pipe closed, process still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def _exchange(self, msg: Any, timeout: float, what: str) -> list[Any]:
        """Send ``msg`` to every host and collect one reply from each, all under one deadline.
        A host that dies or whose pipe closes fails the exchange at once. After a failed exchange
        the pipes are out of step, so every later one fails too."""
        if self.closed:
            raise SliceError(f"{what}: the slice is closed")
        if self._failed is not None:
            raise SliceError(f"{what}: the slice failed earlier: {self._failed}")
        try:
            return self._exchange_once(msg, timeout, what)
        except SliceError as e:
            self._failed = str(e).splitlines()[0]
            raise

    def _exchange_once(self, msg: Any, timeout: float, what: str) -> list[Any]:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        frame = memoryview(HEAD.pack(len(data)) + data)
        for pipe in self._pipes:
            pipe.out = frame
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(self._pipes):
            for rank, pipe in enumerate(self._pipes):
                if rank in replies:
                    continue
                try:
                    pipe.flush()
                except (BrokenPipeError, ConnectionResetError):
                    raise self._died(rank, replies, what) from None
                got, reply = pipe.take_frame()
                if got:
                    replies[rank] = reply
                elif pipe.eof:
                    raise self._died(rank, replies, what)
            if len(replies) == len(self._pipes):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [r for r in range(len(self._pipes)) if r not in replies]
                raise self._error(
                    f"{what}: host(s) {waiting} did not answer within {timeout:.0f} s (hang?); "
                    f"host(s) {sorted(replies)} did", waiting)
            rlist = [p.rfd for r, p in enumerate(self._pipes) if r not in replies]
            wlist = [p.wfd for r, p in enumerate(self._pipes) if r not in replies and p.out]
            readable, _, _ = select.select(rlist, wlist, [], min(left, 1.0))
            for rank, pipe in enumerate(self._pipes):
                if pipe.rfd in readable:
                    pipe.fill()
        for rank, reply in sorted(replies.items()):
            if _is_error(reply):
                raise self._error(f"{what}: host {rank} raised:\n{reply[1]}", [rank])
        return [replies[rank] for rank in range(len(self._pipes))]

    def _died(self, rank: int, replies: dict[int, Any], what: str, grace_s: float = 2.0) -> SliceError:
        """Host ``rank`` died during an exchange. When one host raises and exits, jax.distributed's
        coordination service terminates the others (SIGABRT): the error a host sent is the cause,
        so the other hosts' pipes are read for ``grace_s`` more and an error found there is
        reported first, the death after it."""
        status = self._exit_status(rank)
        deadline = time.monotonic() + grace_s
        while not any(map(_is_error, replies.values())) and (left := deadline - time.monotonic()) > 0:
            for r, pipe in enumerate(self._pipes):
                if r not in replies:
                    got, reply = pipe.take_frame()
                    if got:
                        replies[r] = reply
            open_pipes = {r: p for r, p in enumerate(self._pipes) if r not in replies and r != rank and not p.eof}
            if not open_pipes:
                break
            readable, _, _ = select.select([p.rfd for p in open_pipes.values()], [], [], min(left, 0.2))
            for pipe in open_pipes.values():
                if pipe.rfd in readable:
                    pipe.fill()
        for r, reply in sorted(replies.items()):
            if _is_error(reply):
                return self._error(f"{what}: host {r} raised (and host {rank} died after it: {status}):\n{reply[1]}",
                                   [r, rank])
        return self._error(f"{what}: host {rank} died ({status})", [rank])

    def shutdown(self, timeout: float | None = None) -> list[dict]:
        """A clean shutdown, in vLLM's order: every worker's connector shuts down (with warm restart
        on, each host writes its checkpoint), then the scheduler's. Returns each host's counters.
        The processes are killed afterwards (``close``)."""
        totals = self._exchange(("shutdown",), timeout or self.spec.start_timeout_s, "shutdown")
        self.scheduler.shutdown()
        self.close()
        return totals

    def close(self) -> None:
        """Kill every worker's process group and reap it; safe to call more than once."""
        self.closed = True
        _kill_groups(self.procs)
        self._rank_finalizer()  # DPScheduler's rank processes block forever on their pipes otherwise

    def __enter__(self) -> "PodSlice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- steps
    def add_request(self, request) -> None:
        self.scheduler.add_request(request)

    def make_request(self, req_id: str, prompt: list[int], max_tokens: int):
        """A request as this slice's engine core builds it (its block hasher: the GDN layout's)."""
        if self.spec.gdn is not None:
            from tpuoffload.sim.gdn_layout import make_request

            return make_request(self.gdn, req_id, prompt, max_tokens=max_tokens)
        from tpuoffload.sim.vllm_setup import make_request

        return make_request(req_id, prompt, max_tokens=max_tokens)

    def abort(self, req_ids: Iterable[str]) -> list[str]:
        """Abort requests as the API server does when a client disconnects."""
        from vllm.v1.request import RequestStatus

        live = set(self._live_request_ids())
        req_ids = [r for r in req_ids if r in live]
        if not req_ids:
            return []
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        self.aborted.update(req_ids)
        return req_ids

    def step(self) -> None:
        c = self.chaos
        if c.abort_rate and self._rng.random() < c.abort_rate:
            live = self._live_request_ids()
            if live:
                self.abort([self._rng.choice(live)])
        so = self.scheduler.schedule()
        self.vllm_preemptions += len(getattr(so, "preempted_req_ids", None) or ())
        replies = self._exchange(("step", so), self.spec.step_timeout_s, f"step {self.steps}")
        outputs = [r[0] for r in replies]
        self._check_digests([r[1] for r in replies])
        self._check_outputs(outputs)
        self._note_mismatches(replies)
        outputs = [self._mangle(o) for o in outputs]
        if c.duplicate_report_rate and self._rng.random() < c.duplicate_report_rate:
            outputs.append(outputs[self._rng.randrange(len(outputs))])  # one host's output twice
        merged = self.aggregator.aggregate(outputs, output_rank=0)
        if self.dp_ranks > 1:
            self._absorb_dp_stats(merged)
        eco = self.scheduler.update_from_output(so, merged)
        absorb_outputs(self, eco)
        self.steps += 1
        failed_loads = merged.kv_connector_output.failed_recving if merged.kv_connector_output else None
        if failed_loads and c.abort_failed_load_rate:
            self.abort(r for r in sorted(failed_loads) if self._rng.random() < c.abort_failed_load_rate)

    @property
    def preemptions(self) -> int:
        """Preemptions so far, as the connector counted them (``requests_preempted``): under
        DPScheduler each rank's own, which tpu-inference's combined SchedulerOutput leaves out (so
        ``vllm_preemptions`` stays 0 there)."""
        return self.stats.totals()[C.REQUESTS_PREEMPTED]

    def _absorb_dp_stats(self, merged) -> None:
        """DPScheduler drops ``kv_connector_stats`` when it combines its ranks' stats (tpu-inference
        0.32), so nothing of tpuoffload's reaches vLLM's stats path there: take the workers'
        reports from the merged output, and each rank half's totals from its snapshot file (the
        operator's path too: ``tpuoffload stats``). A rank's totals only grow: one key per rank,
        merged by maximum."""
        from tpuoffload.stats import OffloadStats, make_report

        kv = merged.kv_connector_output if merged is not None else None
        if kv is not None and kv.kv_connector_stats:
            self.stats = self.stats.aggregate(OffloadStats(dict(kv.kv_connector_stats.data)))
        for name, snap in read_rank_snapshots(self.stats_dir).items():
            self.stats = self.stats.aggregate(OffloadStats(make_report(name, 0, snap["totals"])))

    def _mangle(self, output):
        kv = output.kv_connector_output
        if kv is not None and self.chaos.drop_report_rate and self._rng.random() < self.chaos.drop_report_rate:
            kv.kv_connector_worker_meta = None
        return output

    def _check_digests(self, digests) -> None:
        self.digests.append([d.digest for d in digests])
        if len({d.digest for d in digests}) == 1 and len({d.step for d in digests}) == 1:
            for rank, d in enumerate(digests):
                bad = misplaced_op(d.ops)
                if bad is not None:
                    lines = [f"host {rank} dispatched outside the connector's dispatching hooks at step "
                             f"{self.steps} (connector step {d.step}), op #{bad}: a background thread or the "
                             f"forward issued JAX work (invariant 1); the {len(digests)} hosts' digests agree"]
                    lines += [f"  {'>>' if i == bad else '  '} {i:3d} {op}" for i, op in enumerate(d.ops)]
                    raise MisplacedDispatch("\n".join(lines))
            return
        ops = [list(d.ops) for d in digests]
        first = next((i for i in range(max(map(len, ops)))
                      if len({o[i] if i < len(o) else None for o in ops}) > 1), None)
        lines = [f"dispatch digests diverge at step {self.steps} (connector step "
                 f"{sorted({d.step for d in digests})}); first differing op: #{first}"]
        for rank, d in enumerate(digests):
            lines.append(f"  host {rank}: step {d.step} digest {d.digest}, {len(d.ops)} ops")
            lines += [f"  {'>>' if i == first else '  '} {i:3d} {op}" for i, op in enumerate(d.ops)]
        raise DigestMismatch("\n".join(lines))

    def _check_outputs(self, outputs) -> None:
        first = outputs[0]
        for rank, out in enumerate(outputs[1:], 1):
            if out.req_ids != first.req_ids or out.sampled_token_ids != first.sampled_token_ids:
                raise DigestMismatch(
                    f"sampled tokens diverge at step {self.steps}:\n"
                    f"  host 0: {dict(zip(first.req_ids, first.sampled_token_ids))}\n"
                    f"  host {rank}: {dict(zip(out.req_ids, out.sampled_token_ids))}")

    def _note_mismatches(self, replies) -> None:
        """Wrong context reads so far, per host (the runner's count; loads are asynchronous, so a
        forward never reads a block whose load failed: every wrong read is a mismatch)."""
        counts = [r[2] for r in replies]
        if counts != self.mismatches and self.first_mismatch_step is None:
            self.first_mismatch_step = self.steps
        self.mismatches = counts

    def run(self, max_steps: int = 5000, on_step=None, timeout_s: float | None = None) -> int:
        """Step until the scheduler has no requests; returns the number of steps."""
        n = 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.scheduler.has_requests():
            self.step()
            n += 1
            if on_step is not None:
                on_step(self)
            if n >= max_steps:
                raise SliceError(f"not idle after {max_steps} steps")
            if deadline is not None and time.monotonic() > deadline:
                raise SliceError(f"not idle after {timeout_s} s ({n} steps)")
        return n

    def settle(self, timeout: float = 60.0) -> bool:
        """Run empty steps until every save is resolved (confirmed, failed or expired), then wait
        for every host's background writes and deliver their last reports. True if settled."""
        deadline = time.monotonic() + timeout
        # Saves into host RAM and spills to disk alike (a spill whose report was dropped resolves
        # when it expires).
        pending = lambda: sum(r["ledger_pending"] + r.get("disk_ledger_pending", 0)  # noqa: E731
                              for r in self.leak_reports())
        while pending() and time.monotonic() < deadline:
            self.step()
            time.sleep(0.05)
        idle = self._exchange(("idle", max(1.0, deadline - time.monotonic())), self.spec.step_timeout_s + timeout,
                              f"settle after step {self.steps}")
        self.step()  # deliver what the writes that just finished reported
        return not pending() and all(idle)

    def worker_state(self) -> list[dict]:
        """Per host: mismatches, positions_verified, inflight_chunks, staging_bytes, backend_bytes,
        backend_slots_used, steps (after waiting up to 30 s for background writes)."""
        return self._exchange(("state",), self.spec.step_timeout_s + 30, f"worker_state after step {self.steps}")
