"""The seam every tier beside host RAM plugs into, on the worker's side (manager/tier.py is the other).

``OffloadWorker`` holds the host's tiers in a fixed order and, each step, on the engine's main
thread: hands each tier its part of the step plan of its rank (``act``, in ``bind``, before the
step's flush and loads; under DPScheduler a per-rank tier exists once per rank, ``rank``), tells
every tier before a save or an install donates the host stores (``before_donate``), and
collects each tier's part of the host's report (``report``, under its rank's scheduler half). A
tier dispatches JAX work only in ``act`` (invariant 1: the parts are the same on every host, and the
order is the tier list's), using the transfer engine's primitives (read rows, install rows, the
stores); its file I/O runs on its own threads. ``act`` and ``report`` are abstract (a tier that
leaves one out, or misspells it, cannot be built); every other hook has a do-nothing default.
"""

from __future__ import annotations

import abc
from collections import Counter
from typing import Any, NamedTuple

from tpuoffload.messages import SaveBatch


class Placement(NamedTuple):
    """Where the plan a tier acts on sits in the engine's numbering (``StepPlan.placement``): the
    offset of its KV slots and of its save ids (both 0 with one scheduler; under DPScheduler those
    of the tier's rank), and with a GDN/mamba state pool the shift from a state slot of the plan's
    own range (``[kv, kv + state_slots)``) to its slot in the state store (``-kv`` with one
    scheduler; under DPScheduler the rank's share of the store is added: worker/offload_worker.py
    ``_Placed``)."""

    slot_offset: int = 0
    id_offset: int = 0
    state_offset: int = 0


class WorkerTier(abc.ABC):
    """A tier beside host RAM, on the worker's side (the module docstring gives the seam). ``act`` and
    ``report`` must be implemented; the other hooks default to doing nothing."""

    #: The key of this tier's parts in step plans and reports.
    name: str = ""
    #: The scheduler half whose plans this tier acts on and whose reports it writes: with one
    #: scheduler 0; under DPScheduler a tier that keeps a rank's chunks (the disk tier) exists once
    #: per rank, and acts on that rank's plan only (the worker routes each plan's parts).
    rank: int = 0

    @abc.abstractmethod
    def act(self, step: int, part: Any | None, placement: Placement = Placement()) -> None:
        """This step's part of the plan of the tier's rank (None: the plan has none), on the main
        thread; ``placement``: that plan's offsets in the engine's numbering."""

    def before_donate(self) -> None:
        """A save or an install is about to donate the host stores: finish reading them first."""

    def saving(self, batch: SaveBatch) -> None:
        """``batch`` is about to be saved into host RAM."""

    @abc.abstractmethod
    def report(self) -> Any | None:
        """This host's part of the step's report (None: nothing to say)."""

    def take_counters(self) -> Counter[str]:
        """Registered counters since the last call."""
        return Counter()

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the tier's background work; True once none is left."""
        return True

    def idle_report(self) -> dict[str, int]:
        """Gauges that are zero when the tier is idle."""
        return {}

    def close(self) -> None:
        """Clean shutdown (in tier order)."""
