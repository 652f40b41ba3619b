"""The seam every tier beside host RAM plugs into, on the manager's side.

Host RAM is the connector's own store (``ChunkIndex``, ``SavePlanner``, ``LoadTracker``); a tier is
anything else that keeps or moves chunks: the disk tier (``manager/disk_index.py``), warm restart
(``manager/restart.py``), later a shared remote store or peer hosts. ``OffloadScheduler`` holds a
fixed list of tiers and calls each hook on every tier, in list order, at fixed points of vLLM's
hooks; a tier plans into its own part of the step plan (``StepPlan.tiers[name]``) and reads its
own part of the workers' reports (``OffloadWorkerReport.tiers[name]``). Its worker side
(``worker/tier.py``) acts on that part on every host. A tier must say what it plans, how it reads
its reports and what a reset does to it (abstract: a tier that leaves one out, or misspells it,
cannot be built); every other hook has a do-nothing default.

Host-RAM slots are shared: a tier that puts chunks into host RAM (a fetch) takes them like a save
does, through ``SavePlanner.claim`` (the only way a slot becomes SAVING: staging, eviction, one RAM
ledger batch), so the RAM ledger makes them READY like any save.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from tpuoffload.manager.ledger import Resolved


class Tier(abc.ABC):
    """A tier beside host RAM, on the scheduler's side (the module docstring gives the seam).
    ``finish_step``, ``on_report`` and ``reset`` must be implemented; the other hooks default to
    doing nothing."""

    #: The key of this tier's parts in step plans and reports.
    name: str = ""

    @property
    def blocks_saves(self) -> bool:
        """True while no save (and no fetch into host RAM) may be planned: e.g. a checkpoint is
        reading the stores, or restore reports are still due."""
        return False

    @property
    def keeps_engine_stepping(self) -> bool:
        """True while this tier waits for the hosts' reports of work vLLM's requests do not
        account for (a checkpoint being written, restore reports due): vLLM asks
        ``has_pending_push_work`` before it idles, and keeps stepping (steps that schedule no
        token still carry the plan and the reports) while any tier says True. Must turn False by
        itself within a bounded time, reports or not (a tier's own timeout)."""
        return False

    def wants(self, request: "Request", local_blocks: int, ram_hits: int) -> bool:
        """In ``get_num_new_matched_tokens`` (no side effect on the plan): True while the request
        should wait for this tier (vLLM is told "ask again")."""
        return False

    def forget(self, req_id: str) -> None:
        """The request was admitted or finished: drop what the tier keeps for it."""

    def start_step(self, step: int) -> None:
        """First in ``build_connector_meta``, before anything of the step is planned."""

    def plan_into_ram(self, step: int) -> None:
        """While the step's loads are pinned and before its saves: claim host-RAM slots for chunks
        this tier brings back (not called while any tier blocks saves)."""

    @abc.abstractmethod
    def finish_step(self, step: int) -> Any | None:
        """Last: this tier's part of the step plan (None: nothing this step)."""

    @abc.abstractmethod
    def on_report(self, parts: dict[int, Any]) -> None:
        """This tier's part of each host's report (host -> part), once per step's merged report."""

    def on_resolved(self, resolved: "Resolved") -> None:
        """Host-RAM saves resolved (READY or dropped) by the RAM ledger this step."""

    @abc.abstractmethod
    def reset(self, next_save_id: int) -> None:
        """``reset_cache()``: nothing from before it may be loaded again."""

    def leak_report(self) -> dict[str, int]:
        """Gauges that are zero when the engine is idle."""
        return {}
