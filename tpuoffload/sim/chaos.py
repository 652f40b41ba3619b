"""What can go wrong on which host of a simulated pod slice, seeded per host: ``Chaos`` (delays,
a slow host, failed copies, lost slots, dropped and doubled reports, aborts, disk faults, a host
killed in a checkpoint) and the injectors that apply it at the worker's declared fault points."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

from typing_extensions import override
from tpuoffload.backend.disk_tier import DiskFaults
from tpuoffload.persist import PersistFaults
from tpuoffload.worker.faults import FaultInjector, FaultPoint

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
    broken: str | None = None  # negative controls: a variant of sim/broken.py (VARIANTS)
    abort_rate: float = 0.0  # per step: probability of aborting one random live request
    # Per request whose load failed (in the merged output's failed_recving, or owning a block of
    # its invalid_block_ids is unknowable here): probability of aborting it right after that step,
    # a client disconnect in the window where its recompute is still to come.
    abort_failed_load_rate: float = 0.0
    slow_disk_host: int | None = None  # this host's disk tier is slow ...
    slow_disk_s: float = 0.0  # ... by up to this much per chunk file written or read
    fail_disk_host: int | None = None  # this host's disk writes and reads fail ...
    fail_disk_rate: float = 0.0  # ... with this probability each
    die_in_checkpoint_host: int | None = None  # this host is SIGKILLed while its checkpoint is being committed

    @classmethod
    def storm(cls, num_hosts: int, seed: int = 0) -> "Chaos":
        """Everything at once, spread over the hosts (the chaos the pod-slice tests and
        tools/podslice_run.py --chaos run); pair it with a tiny block pool for preemption storms and
        a short ``save_timeout_s`` so saves whose reports were dropped expire."""
        return cls(
            seed=seed, write_delay_s=0.02, step_delay_s=0.01,
            slow_host=num_hosts - 1, slow_host_delay_s=0.05,  # one persistently slow host
            fail_d2h_host=0, fail_d2h_rate=0.25,  # failed device-to-host copies on host 0
            lose_slot_host=1 % num_hosts, lose_slot_rate=0.3,  # local loss: load errors, recompute everywhere
            drop_report_rate=0.05, duplicate_report_rate=0.1,  # reports lost (saves expire) and doubled
            abort_rate=0.08,  # aborts at random steps
            slow_disk_host=0, slow_disk_s=0.02,  # the disk tier (when on): one slow disk ...
            fail_disk_host=num_hosts - 1, fail_disk_rate=0.2,  # ... and failed writes and reads on another
        )


class ChaosDiskFaults(DiskFaults):
    """``Chaos``'s disk faults for one host's disk tier (runs on the tier's threads): a slow disk
    sleeps before each write and read; a failing one raises with ``fail_disk_rate``."""

    def __init__(self, chaos: Chaos, host: int) -> None:
        self.slow = chaos.slow_disk_s if chaos.slow_disk_host == host else 0.0
        self.fail = chaos.fail_disk_rate if chaos.fail_disk_host == host else 0.0
        self._rng = random.Random(chaos.seed * 2000 + host)
        self._lock = threading.Lock()  # guards _rng (several tier threads)

    def _maybe(self, what: str) -> None:
        with self._lock:
            delay = self._rng.uniform(0, self.slow) if self.slow else 0.0
            fail = self.fail > 0 and self._rng.random() < self.fail
        if delay:
            time.sleep(delay)
        if fail:
            raise OSError(f"injected disk {what} failure")

    @override
    def before_write(self, key) -> None:
        self._maybe("write")

    @override
    def before_read(self, key) -> None:
        self._maybe("read")


class DieInCheckpoint(PersistFaults):
    """The host dies (SIGKILL, no cleanup) right after it started writing its part of a checkpoint."""

    @override
    def after_save_started(self, seq: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class PointFaults:
    """Exceptions at the worker's declared fault points on one host (beyond ``Chaos``):
    at each point named in ``points``, the whole operation raises with probability ``rate``."""

    host: int = 0
    rate: float = 0.0
    points: tuple[str, ...] = field(default_factory=lambda: tuple(p.name for p in FaultPoint))


class ChaosInjector(FaultInjector):
    """``Chaos`` (and optional ``PointFaults``) for one host, as the worker's ``FaultInjector``.

    ================  ===========================================================
    point             what this host does there
    ================  ===========================================================
    SAVE_RECORD       sleeps up to ``write_delay_s`` (every host), plus
                      ``slow_host_delay_s`` on ``slow_host``
    SAVE_PROGRAM      raises with ``fail_d2h_rate`` on ``fail_d2h_host`` (the save fails)
    LOAD_SLOT_CHECK   with ``lose_slot_rate`` on ``lose_slot_host``: one random position
                      fails alone (a lost slot: a load error, recomputed on every host)
    any point         raises with ``PointFaults.rate`` on ``PointFaults.host``
    ================  ===========================================================

    Seeded per host. ``hit`` runs on the engine's main thread and on its save threads.
    """

    def __init__(self, chaos: Chaos, host: int, point_faults: PointFaults | None = None) -> None:
        self.chaos = chaos
        self.host = host
        self.point_faults = point_faults if point_faults is not None and point_faults.host == host else None
        self._rng = random.Random(chaos.seed * 1000 + host)
        self._lock = threading.Lock()  # guards _rng and hits (hit runs on the main thread and the save threads)
        self.hits: dict[str, int] = {}  # point name -> faults injected there

    def _draw(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    @override
    def hit(self, point: FaultPoint, n: int) -> set[int]:
        c, name = self.chaos, point.name
        delay, fail, lost = 0.0, None, set()
        with self._lock:
            pf = self.point_faults
            if pf is not None and name in pf.points and self._draw(pf.rate):
                fail = f"chaos: {name} failed on host {self.host}"
            elif name == "SAVE_RECORD":
                if c.write_delay_s:
                    delay = self._rng.uniform(0, c.write_delay_s)
                if c.slow_host == self.host:
                    delay += c.slow_host_delay_s
            elif name == "SAVE_PROGRAM" and c.fail_d2h_host == self.host and self._draw(c.fail_d2h_rate):
                fail = f"chaos: device-to-host copy failed on host {self.host}"
            elif name == "LOAD_SLOT_CHECK" and c.lose_slot_host == self.host and n and self._draw(c.lose_slot_rate):
                lost = {self._rng.randrange(n)}
            if fail is not None or lost:
                self.hits[name] = self.hits.get(name, 0) + 1
        if delay:
            time.sleep(delay)
        if fail is not None:
            raise RuntimeError(fail)
        return lost
