"""A simulated pod slice: one scheduler process and N JAX worker processes on this machine.

The workers are joined by ``jax.distributed`` (CPU devices, gloo collectives) into one mesh whose
heads axis spans every process, so each worker holds only its own heads of every block, as a host
of a TPU pod slice does. Every step the scheduler sends the same SchedulerOutput to every worker,
merges their outputs with vLLM's KVOutputAggregator, and compares the per-host dispatch digests;
the first divergence stops the run with each host's op list.

No run can hang: every receive has a deadline, the JAX heartbeat brings the others down when one
dies, and ``close`` kills each worker's process group.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

from tpuoffload.worker.transfer_engine import Faults


class SliceError(RuntimeError):
    """The slice stopped: a worker died, timed out, or the hosts diverged."""


class DigestMismatch(SliceError):
    pass


@dataclass
class Chaos:
    """What can go wrong on which host. Everything is seeded, per host."""

    seed: int = 0
    write_delay_s: float = 0.0  # max random delay before each background write, every host
    step_delay_s: float = 0.0  # max random delay before each step, every host
    slow_host: int | None = None  # this host's writes are always slow ...
    slow_host_delay_s: float = 0.0  # ... by this much
    fail_d2h_host: int | None = None  # this host's background copies fail ...
    fail_d2h_rate: float = 0.0  # ... with this probability
    lose_slot_host: int | None = None  # this host loses slots before loads (local loss) ...
    lose_slot_rate: float = 0.0  # ... with this probability per load
    drop_report_rate: float = 0.0  # a worker's completion report is dropped on the way
    duplicate_report_rate: float = 0.0  # a worker's output is delivered twice to the aggregator
    broken: str | None = None  # negative controls: "host_order" or "background_dispatch"


class ChaosFaults(Faults):
    def __init__(self, chaos: Chaos, host: int) -> None:
        self.chaos = chaos
        self.host = host
        self.rng = random.Random(chaos.seed * 1000 + host)

    def before_write(self, save_ids: Sequence[int]) -> None:
        c = self.chaos
        delay = self.rng.uniform(0, c.write_delay_s) if c.write_delay_s else 0.0
        if c.slow_host == self.host:
            delay += c.slow_host_delay_s
        if delay:
            time.sleep(delay)
        if c.fail_d2h_host == self.host and self.rng.random() < c.fail_d2h_rate:
            raise RuntimeError("chaos: device-to-host copy failed")

    def before_load(self, backend, slots: Sequence[int]) -> None:
        c = self.chaos
        if c.lose_slot_host == self.host and slots and self.rng.random() < c.lose_slot_rate:
            backend.invalidate([self.rng.choice(list(slots))])


# ---------------------------------------------------------------- framing over pipes
def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _recv(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("peer closed the pipe")
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SliceSpec:
    num_hosts: int = 2
    devices_per_host: int = 2
    num_blocks: int = 96
    block_size: int = 16
    num_layers: int = 2
    num_kv_heads: int = 8
    head_dim: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    extra_config: dict[str, Any] = field(default_factory=lambda: {"cpu_bytes_to_use": 1 << 22})
    step_timeout_s: float = 60.0
    start_timeout_s: float = 120.0


class PodSlice:
    """Start with ``PodSlice(spec, chaos)``; use as a context manager so the workers always die."""

    def __init__(self, spec: SliceSpec, chaos: Chaos | None = None, log_dir: str | None = None) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        from tpuoffload.sim.vllm_setup import make_scheduler

        self.spec = spec
        self.chaos = chaos or Chaos()
        self._rng = random.Random(self.chaos.seed)
        if spec.num_kv_heads % (spec.num_hosts * spec.devices_per_host):
            raise ValueError(f"num_kv_heads={spec.num_kv_heads} must divide over "
                             f"{spec.num_hosts} hosts x {spec.devices_per_host} devices")
        self.scheduler = make_scheduler(
            num_blocks=spec.num_blocks, block_size=spec.block_size, kv_connector_extra_config=spec.extra_config,
            max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
            num_layers=spec.num_layers,
            # The cache's heads axis holds K and V heads together (as tpu-inference's does) and each
            # host holds its share; vLLM's per-worker page (K and V) then covers exactly one host slot.
            num_kv_heads=max(1, spec.num_kv_heads // (2 * spec.num_hosts)), head_size=spec.head_dim,
            tensor_parallel_size=spec.num_hosts,
        )
        self.aggregator = KVOutputAggregator.from_connector(self.scheduler.connector, spec.num_hosts)
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir
        self.steps = 0
        self.digests: list[list[str]] = []  # per step, per host
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.final: list[dict] = []
        self._start()

    @property
    def offload(self):
        return self.scheduler.connector.scheduler

    # ---------------------------------------------------------------- processes
    def _start(self) -> None:
        port = free_port()
        env = dict(os.environ)
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={self.spec.devices_per_host}",
                   HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", PYTHONUNBUFFERED="1")
        init = {"spec": asdict(self.spec), "chaos": asdict(self.chaos),
                "vllm_config": self.scheduler.vllm_config, "kv_cache_config": self.scheduler.kv_cache_config}
        for rank in range(self.spec.num_hosts):
            log = open(os.path.join(self.log_dir, f"host{rank}.log"), "wb") if self.log_dir else subprocess.DEVNULL
            proc = subprocess.Popen(
                [sys.executable, "-m", "tpuoffload.sim.podslice", str(rank), str(self.spec.num_hosts), str(port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
            )
            self.procs.append(proc)
            _send(proc.stdin, init)
        for rank, proc in enumerate(self.procs):
            msg = self._recv(rank, self.spec.start_timeout_s)
            if msg != "ready":
                raise SliceError(f"host {rank} failed to start: {msg!r}")

    def _recv(self, rank: int, timeout: float) -> Any:
        import select

        proc = self.procs[rank]
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            raise SliceError(f"host {rank} did not answer within {timeout:.0f} s (hang?)")
        try:
            return _recv(proc.stdout)
        except EOFError:
            raise SliceError(f"host {rank} died (exit code {proc.poll()})") from None

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.wait(timeout=30)
        self.procs = []

    def __enter__(self) -> "PodSlice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- steps
    def add_request(self, request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> None:
        so = self.scheduler.schedule()
        for proc in self.procs:
            _send(proc.stdin, ("step", so))
        replies = [self._recv(rank, self.spec.step_timeout_s) for rank in range(len(self.procs))]
        for rank, reply in enumerate(replies):
            if isinstance(reply, tuple) and reply[0] == "error":
                raise SliceError(f"host {rank} raised:\n{reply[1]}")
        self._check_digests([r[1] for r in replies])
        outputs = [self._mangle(r[0]) for r in replies]
        if self.chaos.duplicate_report_rate and self._rng.random() < self.chaos.duplicate_report_rate:
            outputs.append(outputs[self._rng.randrange(len(outputs))])  # one host's output twice
        merged = self.aggregator.aggregate(outputs, output_rank=0)
        eco = self.scheduler.update_from_output(so, merged)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        self.steps += 1

    def _mangle(self, output):
        kv = output.kv_connector_output
        if kv is not None and self.chaos.drop_report_rate and self._rng.random() < self.chaos.drop_report_rate:
            kv.kv_connector_worker_meta = None
        return output

    def _check_digests(self, digests) -> None:
        self.digests.append([d.digest for d in digests])
        if len({d.digest for d in digests}) > 1:
            lines = [f"dispatch digests diverge at step {digests[0].step}:"]
            for rank, d in enumerate(digests):
                lines.append(f"  host {rank}: {d.digest}")
                lines += [f"    {op}" for op in d.ops]
            raise DigestMismatch("\n".join(lines))

    def run(self, max_steps: int = 5000, on_step=None) -> int:
        n = 0
        while self.scheduler.has_requests():
            self.step()
            n += 1
            if on_step is not None:
                on_step(self)
            if n >= max_steps:
                raise SliceError(f"not idle after {max_steps} steps")
        return n

    def settle(self, timeout: float = 60.0) -> None:
        """Run empty steps until every save is resolved (confirmed, failed or expired)."""
        deadline = time.monotonic() + timeout
        while self.offload.leak_report()["ledger_pending"] and time.monotonic() < deadline:
            self.step()
            time.sleep(0.05)

    def worker_state(self) -> list[dict]:
        for proc in self.procs:
            _send(proc.stdin, ("state",))
        return [self._recv(rank, self.spec.step_timeout_s) for rank in range(len(self.procs))]


# ---------------------------------------------------------------- worker process
def _worker_main(rank: int, num_hosts: int, port: int) -> None:
    import traceback

    # Keep the pipe for frames only: anything a library prints to fd 1 goes to the log instead.
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    init = _recv(stdin)
    spec, chaos = SliceSpec(**init["spec"]), Chaos(**init["chaos"])

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_hosts, rank, initialization_timeout=int(spec.start_timeout_s),
                               heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
    import numpy as np
    from jax.sharding import Mesh
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector
    from tpuoffload.sim.runner import SyntheticRunner

    mesh = Mesh(np.array(jax.devices()), ("model",))  # ordered by process: each host owns its heads
    runner = SyntheticRunner(mesh, num_blocks=spec.num_blocks, block_size=spec.block_size,
                             num_layers=spec.num_layers, num_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    connector = TPUOffloadConnector(init["vllm_config"], KVConnectorRole.WORKER, init["kv_cache_config"])
    connector.worker.host_id = rank
    connector.worker._faults = ChaosFaults(chaos, rank)
    connector.register_runner(runner)
    if chaos.broken:
        from tpuoffload.sim.broken import break_engine

        break_engine(connector.worker.engine, chaos.broken, rank)
    rng = random.Random(chaos.seed * 7 + rank)
    _send(stdout, "ready")
    while True:
        msg = _recv(stdin)
        try:
            if msg[0] == "step":
                if chaos.step_delay_s:
                    time.sleep(rng.uniform(0, chaos.step_delay_s))
                out = runner.execute(msg[1], connector)
                _send(stdout, (out, connector.worker.digests[-1]))
            elif msg[0] == "state":
                eng = connector.worker.engine
                eng.wait_idle(30)
                chunks, staging, _ = eng.inflight()
                _send(stdout, {"host": rank, "mismatches": runner.stats.mismatches,
                               "positions_verified": runner.stats.positions_verified,
                               "inflight_chunks": chunks, "staging_bytes": staging,
                               "backend_bytes": eng.backend.nbytes, "steps": runner.stats.steps})
        except Exception:
            _send(stdout, ("error", traceback.format_exc()))


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
