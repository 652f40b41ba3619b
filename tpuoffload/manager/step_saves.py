"""What a step's forward leaves to save: the one seam for the save policy and the cache's shape.

``OffloadScheduler`` picks one ``StepSaves`` at construction, from the configuration and vLLM's KV
cache groups, and asks it once per step; nothing in the scheduler half branches on either per step.

* ``EagerSaves``: the full blocks this step's forward completes, planned in this step so the
  workers gather them right after the forward, before vLLM can reuse them (invariant 9). One KV
  cache group: hashes as whole runs per request (no per-block copy). Several groups (hybrid models:
  sliding window, GDN state): block by block over every group, keyed by hash and group, each
  candidate with its slot pool (``KVCacheGroups.candidates``).
* ``LazySaves``: nothing now; the request's computed blocks are remembered and flushed when it
  finishes or is preempted (``RequestLifecycle``, the step's flush).

``block_ids_of(req_id)`` gives a request's block ids as ``KVCacheGroups.ours`` selects them (group
0's list with one group, every group's with several).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from typing_extensions import override

from tpuoffload.manager.events import GroupedOrigins
from tpuoffload.manager.hash_table import PackedHashes
from tpuoffload.manager.kv_groups import KVCacheGroups
from tpuoffload.manager.lifecycle import RequestLifecycle

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

BlockIdsOf = Callable[[str], Any]


@dataclass(frozen=True)
class SaveCandidates:
    """A step's save candidates, in the order ``SavePlanner.plan`` takes them."""

    block_ids: Sequence[int]
    keys: PackedHashes
    origins: Any  # where each candidate comes from (events.py: request runs, or GroupedOrigins)
    pools: np.ndarray | None = None  # each candidate's slot pool (None: every one the KV pool's)


class StepSaves(ABC):
    """The save candidates of one step, read from vLLM's scheduler output."""

    @abstractmethod
    def candidates(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> SaveCandidates | None:
        """The blocks this step's forward fills that are to be saved now (None: nothing). Called
        once per step, in ``build_connector_meta``, after preemptions were applied."""

    @staticmethod
    def of(requests: RequestLifecycle, groups: KVCacheGroups, lazy: bool) -> "StepSaves":
        """The one implementation for this configuration and cache."""
        if lazy:
            return LazySaves(requests)
        return GroupedSaves(requests, groups) if groups.several else EagerSaves(requests)


class LazySaves(StepSaves):
    """Lazy offload: remember what each request computed; its flush saves it later."""

    def __init__(self, requests: RequestLifecycle) -> None:
        self._requests = requests

    @override
    def candidates(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> None:
        self._requests.track_computed(so, block_ids_of)
        return None


class EagerSaves(StepSaves):
    """One KV cache group: each request's newly full blocks, hashes as runs."""

    def __init__(self, requests: RequestLifecycle) -> None:
        self._requests = requests

    @override
    def candidates(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> SaveCandidates | None:
        blocks, runs, origins = self._requests.step_candidates(so, block_ids_of)
        return SaveCandidates(blocks, PackedHashes.of_runs(runs), origins) if blocks else None


class GroupedSaves(StepSaves):
    """Several KV cache groups: every group's newly full blocks, block by block, keyed by group;
    a GDN state row only at the exact boundary a step computes (``KVCacheGroups.state_ids``)."""

    def __init__(self, requests: RequestLifecycle, groups: KVCacheGroups) -> None:
        self._requests = requests
        self._groups = groups

    @override
    def candidates(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> SaveCandidates | None:
        groups = self._groups
        spans = [(r, groups.state_ids(block_ids_of(r.request_id), full, exact), start, full)
                 for r, start, full, exact in self._requests.step_spans(so)]
        if not spans:
            return None
        blocks, keys, pools = groups.candidates([(ids, r.block_hashes, start, full) for r, ids, start, full in spans])
        return SaveCandidates(blocks, keys, GroupedOrigins(spans), pools) if blocks else None
