"""Loads: lookups while vLLM decides, loads planned at admission, loads in flight until reported.

A load's life::

    lookup (get_num_new_matched_tokens; no side effect, asked again every step until admission)
      -> planned (update_state_after_alloc with external tokens: vLLM now waits for it)
      -> emitted in the step's plan iff vLLM still waits for it (the request is WAITING_FOR_REMOTE_KVS);
         otherwise cancelled and counted (vLLM would assert on a completion it does not expect)
      -> in flight until the workers report it (finished_recving); blocks they could not load come
         back in invalid_block_ids and their chunks are discarded so they are not offered again.

A load vLLM waits for is always emitted, so ``finished_recving`` always comes back and no request
waits forever (issue 12). The slots a step's loads read are pinned while that step's saves are
allocated, so no eviction in the same plan can hand them to a save (invariant 11 via 7).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tpuoffload import counters as C
from tpuoffload.messages import LoadRequest
from tpuoffload.manager.index import ChunkIndex, SavedPrefix
from tpuoffload.manager.kv_groups import NULL_BLOCK, GroupedHit, KVCacheGroups
from tpuoffload.manager.rank_view import RankView

if TYPE_CHECKING:
    from vllm.v1.request import Request

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class _Lookup:
    local: int  # blocks vLLM's own prefix cache covers
    found: SavedPrefix | GroupedHit  # the READY blocks right after them: host slots and save ids
    version: int  # ``LoadTracker._version()`` when looked up: ``found`` is exact while it is unchanged


#: The memo of a lookup whose first block missed (version -1: never taken for exact; a plan
#: with it looks again, from block 0, as with no memo).
_MISS = _Lookup(0, SavedPrefix(_EMPTY, _EMPTY), -1)


@dataclass(slots=True)
class _Planned:
    request: "Request"
    load: LoadRequest
    slots: np.ndarray


class LoadTracker:
    """Loads from lookup to report (the module docstring gives a load's life): side-effect-free
    lookups, loads planned at admission, emitted only while vLLM waits for them, pinned while
    the step's saves are planned, and their failures discarded so they are not offered again."""

    def __init__(self, index: ChunkIndex, block_size: int, counters: Counter[str],
                 groups: KVCacheGroups = KVCacheGroups(), view: RankView = RankView(1, 0)) -> None:
        self.index = index
        # Under DPScheduler: the other ranks' READY chunks (rank_view.py), used where the rank's
        # own index has none; empty otherwise.
        self.view = view
        self.groups = groups
        self.block_size = block_size
        self.counters = counters
        self._lookups: dict[str, _Lookup] = {}
        self._planned: dict[str, _Planned] = {}  # this step's admissions with a load
        self._in_flight: dict[str, LoadRequest] = {}  # emitted, not yet reported by the workers

    # ------------------------------------------------------------------ gauges
    def num_planned(self) -> int:
        return len(self._planned)

    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------------ lookups
    def lookup(self, request: "Request", num_computed_tokens: int) -> int:
        """Blocks beyond the local hit that host RAM holds READY; no effect on the index. The
        answer is memoised for the admission, and given again when vLLM asks again (it does, every
        step, until it admits the request) as long as no chunk has left the index since (the
        memoised slots are then still READY; chunks that became READY since are not counted:
        at worst a few blocks are recomputed)."""
        bs = self.block_size
        local = num_computed_tokens // bs
        req_id = request.request_id
        memo = self._lookups.get(req_id)
        if self.groups.several:
            return self._lookup_groups(request, local, memo)
        if memo is not None and memo.local == local and memo.version == self._version():
            return len(memo.found.slots)
        # Leave at least one token to compute: vLLM needs a token to sample from.
        found = self._find(request.block_hashes, local, (request.num_tokens - 1) // bs)
        # A miss (the usual answer: one probe of the first block) is not worth a memo of its own.
        self._lookups[req_id] = _Lookup(local, found, self._version()) if len(found.slots) else _MISS
        return len(found.slots)

    def _find(self, hashes, start: int, stop: int) -> SavedPrefix:
        """The READY chunks of ``hashes[start:stop]``, from the rank's own index and, where it has
        none, from the other ranks' (DPScheduler)."""
        found = self.index.ready_prefix_saved(hashes, start, stop)
        if self.view and start + len(found.slots) < min(stop, len(hashes)):
            found = self.view.extend(self.index, hashes, start, stop, found)
        return found

    def _version(self) -> int:
        """Changes whenever a READY chunk, the rank's own or another rank's, may have left."""
        return self.index.version + self.view.version

    def _lookup_groups(self, request: "Request", local: int, memo: _Lookup | None) -> int:
        """``lookup`` with several KV cache groups: a hit every group can serve (kv_groups.py)."""
        if memo is not None and memo.local == local and memo.version == self._version():
            return memo.found.n
        found = self.groups.find_hit(self.index, request.block_hashes, local, (request.num_tokens - 1) // self.block_size,
                                     self.view or None)
        self._lookups[request.request_id] = _Lookup(local, found, self._version()) if found.n else _MISS
        return found.n

    def take_lookup(self, req_id: str) -> _Lookup | None:
        return self._lookups.pop(req_id, None)

    def forget(self, req_id: str) -> bool:
        """The request finished: drop its lookup and any load not emitted yet. Returns whether a
        load of it is still in flight (vLLM holds its blocks until that is reported)."""
        self._lookups.pop(req_id, None)
        if self._planned.pop(req_id, None) is not None:
            self.counters[C.LOADS_CANCELLED] += 1
        return req_id in self._in_flight

    def clear_lookups(self) -> None:
        self._lookups.clear()

    # ------------------------------------------------------------------ planning
    def plan(self, request: "Request", lookup: _Lookup | None, num_blocks: int, block_ids) -> None:
        """vLLM admitted ``request`` expecting ``num_blocks`` blocks from host RAM, right after
        its local hit, into ``block_ids`` (all its block ids; with several KV cache groups, one
        list per group). Blocks promised but no longer READY are listed as unavailable: the workers
        report them as load errors and vLLM recomputes (invariant 11: a missing load is explicit)."""
        if self.groups.several:
            return self._plan_groups(request, lookup, num_blocks, block_ids)
        if lookup is not None and lookup.version == self._version():
            local, found = lookup.local, lookup.found
        else:  # no memo, or the index changed since: look again
            local = lookup.local if lookup is not None else 0
            found = self._find(request.block_hashes, local, local + num_blocks)
        slots = found.slots[:num_blocks]
        ready = len(slots)
        slot_seq, save_ids = found.listed(ready)
        self._planned[request.request_id] = _Planned(request, LoadRequest(
            req_id=request.request_id,
            block_ids=tuple(block_ids[local:local + ready]),
            # Usually runs (a prefix saved in one batch): ranges, a few bytes on the wire.
            slots=slot_seq,
            save_ids=save_ids,
            unavailable_block_ids=tuple(block_ids[local + ready:local + num_blocks]),
        ), self._own(slots))

    def _plan_groups(self, request: "Request", lookup: _Lookup | None, num_blocks: int,
                     block_ids: tuple[list[int], ...]) -> None:
        """``plan`` with several KV cache groups: each group loads its part of a hit of exactly
        ``num_blocks`` (a full-attention group all of it, a sliding-window group the window's tail),
        into its own block ids. A hit no longer servable whole fails the request (vLLM takes load
        failures of several groups only by request): nothing is copied and the workers report it."""
        local = lookup.local if lookup is not None else 0
        hit = lookup.found if lookup is not None and lookup.version == self._version() else None
        if hit is None or hit.n != num_blocks:
            hit = self.groups.find_hit(self.index, request.block_hashes, local, local + num_blocks, self.view or None)
        targets = [ids[local + first:local + hit.n] for ids, first in zip(block_ids, hit.first)]
        if hit.n != num_blocks or any(NULL_BLOCK in t for t in targets):
            promised = tuple(b for ids in block_ids for b in ids[local:local + num_blocks] if b != NULL_BLOCK)
            load = LoadRequest(request.request_id, (), (), (), unavailable_block_ids=promised or (NULL_BLOCK,))
            self._planned[request.request_id] = _Planned(request, load, _EMPTY)
            return
        slots = hit.all_slots()
        load = LoadRequest(req_id=request.request_id, block_ids=tuple(b for t in targets for b in t),
                           slots=tuple(slots.tolist()), save_ids=tuple(np.concatenate(hit.save_ids).tolist()))
        self._planned[request.request_id] = _Planned(request, load, self._own(slots))

    def _own(self, slots: np.ndarray) -> np.ndarray:
        """The slots of a load this rank owns (to pin); the others are other ranks' chunks
        (DPScheduler: never pinned here), counted as cross-rank hit tokens."""
        own = (slots >= 0) & (slots < self.index.num_slots)
        if own.all():
            return slots
        self.counters[C.CROSS_RANK_HIT_TOKENS] += int((~own).sum()) * self.block_size
        return slots[own]

    def emit(self, waiting: Callable[["Request"], bool]) -> tuple[tuple[LoadRequest, ...], np.ndarray]:
        """This step's loads: the planned loads vLLM still waits for (``waiting(request)``), and
        the slots they read, in load order (to pin while this step's saves are allocated).
        Enforces "a load vLLM waits for is always sent, and only those" (issue 12: a dropped one
        left the request waiting forever; an unexpected one makes vLLM assert)."""
        if not self._planned:
            return (), _EMPTY
        loads, slots = [], []
        for req_id, planned in self._planned.items():
            if not waiting(planned.request):
                self.counters[C.LOADS_CANCELLED] += 1
                continue
            loads.append(planned.load)
            slots.append(planned.slots)
            self._in_flight[req_id] = planned.load
        self._planned.clear()
        return tuple(loads), (np.concatenate(slots) if slots else _EMPTY)

    # ------------------------------------------------------------------ reports
    def finished(self, req_ids: Iterable[str]) -> set[str]:
        """The workers reported these loads done. Returns those that were this half's loads in
        flight (the rest are another DP rank's, or unknown)."""
        return {req_id for req_id in req_ids if self._in_flight.pop(req_id, None) is not None}

    def failed_requests(self, req_ids: Iterable[str]) -> list[tuple[int, int]]:
        """(slot, save_id) of every chunk the in-flight loads of these requests read (failures by
        request: each such load's chunks are all suspect); counts this half's failed requests."""
        out = []
        for req_id in req_ids:
            load = self._in_flight.get(req_id)
            if load is not None:  # (another DP rank's request is not)
                self.counters[C.FAILED_REQUESTS] += 1
                out += zip(load.slots, load.save_ids)
        return out

    def failed_blocks(self, block_ids: Iterable[int]) -> list[tuple[int, int]]:
        """(slot, save_id) of the in-flight loads' chunks whose target block failed to load."""
        bad = set(block_ids)
        if not bad:
            return []
        out = []
        for load in self._in_flight.values():
            for block, slot, save_id in zip(load.block_ids, load.slots, load.save_ids):
                if block in bad:
                    out.append((slot, save_id))
        return out
