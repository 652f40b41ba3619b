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
* ``GroupedLazySaves``: lazy offload with several KV cache groups. A flush saves only the groups
  vLLM keeps a request's blocks in until it finishes or is preempted (full attention,
  ``KVCacheGroups.held_to_finish``); the others are saved in the step of their forward, as eager
  mode saves them: a sliding-window group frees each block that leaves its window while the
  request runs, and vLLM may hand it to another request at once, so by the flush a remembered id
  of that group may hold another request's KV (and a GDN state row holds a boundary's state only in
  the step that computed it).

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
from tpuoffload.manager.kv_groups import NULL_BLOCK, KVCacheGroups
from tpuoffload.manager.lifecycle import RequestLifecycle, Span

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

    @abstractmethod
    def flush(self, spans: Sequence[Span]) -> SaveCandidates | None:
        """The save candidates of the step's flush (``RequestLifecycle.take_flush``: blocks of
        finished or preempted requests, remembered while they ran), gathered before anything else
        of the step: only blocks that still hold the request's KV then (invariant 9). None:
        nothing."""

    @staticmethod
    def of(requests: RequestLifecycle, groups: KVCacheGroups, lazy: bool) -> "StepSaves":
        """The one implementation for this configuration and cache."""
        if lazy:
            return GroupedLazySaves(requests, groups) if groups.several else LazySaves(requests)
        return GroupedSaves(requests, groups) if groups.several else EagerSaves(requests)


def _one_group(spans: Sequence[Span]) -> SaveCandidates | None:
    """One KV cache group's spans as save candidates (hashes as runs per request)."""
    blocks = [b for _, ids, start, full in spans for b in ids[start:full]]
    if not blocks:
        return None
    runs = [r.block_hashes[start:full] for r, _, start, full in spans]
    return SaveCandidates(blocks, PackedHashes.of_runs(runs), [(r, start, full - start, 0) for r, _, start, full in spans])


def _grouped(groups: KVCacheGroups, spans: Sequence[Span]) -> SaveCandidates | None:
    """Several KV cache groups' spans (block ids per group, null where a group saves nothing) as
    save candidates, block by block, keyed by group (``KVCacheGroups.candidates``)."""
    if not spans:
        return None
    blocks, keys, pools = groups.candidates([(ids, r.block_hashes, start, full) for r, ids, start, full in spans])
    return SaveCandidates(blocks, keys, GroupedOrigins(spans), pools) if blocks else None


def _only(block_ids: Sequence[Sequence[int]], keep: Sequence[bool], full: int) -> list[Sequence[int]]:
    """``block_ids`` (per group) with every group not in ``keep`` null up to block ``full``."""
    nulls = [NULL_BLOCK] * full  # shared by the groups left out (read, never written)
    return [ids if k else nulls for ids, k in zip(block_ids, keep)]


class LazySaves(StepSaves):
    """Lazy offload: remember what each request computed; its flush saves it later."""

    def __init__(self, requests: RequestLifecycle) -> None:
        self._requests = requests

    @override
    def candidates(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> None:
        self._requests.track_computed(so, block_ids_of)
        return None

    @override
    def flush(self, spans: Sequence[Span]) -> SaveCandidates | None:
        # One group: vLLM frees none of a request's blocks before it finishes or is preempted.
        return _one_group(spans)


class EagerSaves(StepSaves):
    """One KV cache group: each request's newly full blocks, hashes as runs."""

    def __init__(self, requests: RequestLifecycle) -> None:
        self._requests = requests

    @override
    def candidates(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> SaveCandidates | None:
        blocks, runs, origins = self._requests.step_candidates(so, block_ids_of)
        return SaveCandidates(blocks, PackedHashes.of_runs(runs), origins) if blocks else None

    @override
    def flush(self, spans: Sequence[Span]) -> None:
        return None  # eager mode queues no flush


class GroupedSaves(StepSaves):
    """Several KV cache groups: every group's newly full blocks, block by block, keyed by group;
    a GDN state row only at the exact boundary a step computes (``KVCacheGroups.state_ids``)."""

    def __init__(self, requests: RequestLifecycle, groups: KVCacheGroups) -> None:
        self._requests = requests
        self._groups = groups

    @override
    def candidates(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> SaveCandidates | None:
        groups = self._groups
        return _grouped(groups, [(r, groups.state_ids(block_ids_of(r.request_id), full, exact), start, full)
                                 for r, start, full, exact in self._requests.step_spans(so)])

    @override
    def flush(self, spans: Sequence[Span]) -> None:
        return None  # eager mode queues no flush


class GroupedLazySaves(GroupedSaves):
    """Lazy offload with several KV cache groups (module doc): the groups vLLM holds until the
    finish are flushed from the ids remembered while the request ran; every other group's blocks
    are saved in the step of their forward, as ``GroupedSaves`` saves them."""

    @override
    def candidates(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> SaveCandidates | None:
        groups = self._groups
        eager = [not held for held in groups.held_to_finish]
        return _grouped(groups, [(r, _only(groups.state_ids(ids, full, exact), eager, full), start, full)
                                 for r, ids, start, full, exact in self._requests.lazy_spans(so, block_ids_of)])

    @override
    def flush(self, spans: Sequence[Span]) -> SaveCandidates | None:
        held = self._groups.held_to_finish
        return _grouped(self._groups, [(r, _only(ids, held, full), start, full) for r, ids, start, full in spans])
