"""The disk tier, the scheduler's side: what every host's disk holds, and fetches back into RAM.

Every host's disk tier holds the same chunks, because the scheduler decides every write (a spill of
a chunk evicted from host RAM), every delete (a disk eviction) and every read (a fetch), and the
hosts only carry them out. ``DiskIndex`` reuses the host-RAM bookkeeping for it: a ``ChunkIndex``
whose "slots" are disk chunk numbers (``capacity``: ``files_per_rank`` of them, so the budget is
never exceeded) and a ``CompletionLedger`` of disk writes, so a spilled chunk is fetchable only
once every host wrote it (invariant 7), a write that failed anywhere is forgotten (invariant 11),
and a chunk being fetched is pinned against disk eviction. Under DPScheduler each rank's half has
its own disk index over its own files (docs/design.md, "The disk tier per rank"): "every host" is
then every host holding a piece of the rank's batch shard, the others confirming what they hold no
byte of.

With a GDN/mamba state pool (manager/kv_groups.py) the disk index has the host-RAM index's pools
too: entries ``[0, kv)`` are KV chunk files, ``[kv, kv + state)`` state chunk files (each pool its
own budget, ``OffloadConfig.disk_pool_bytes``, its own LRU order), a spill goes to the pool of
the host-RAM slot it leaves, a fetch claims a host-RAM slot of the pool its file is in, and every
``DiskBatch`` names each chunk's pool (``DiskBatch.pools``), which the workers keep in a
directory per pool.

A fetch (``FetchPlanner``) is a save into host RAM whose bytes come from disk:

    lookup (get_num_new_matched_tokens): host RAM's prefix stops where the disk's continues ->
        the request waits (vLLM is told None: "ask again"), the fetch is wanted
    plan (build_connector_meta, with the step's loads pinned): RAM slots allocated (evictions
        spill), one RAM ledger batch, the disk chunks pinned -> ``meta.fetch``
    the hosts read in the background and write the slots at the start of the next step, and
        report it like a save -> every host confirmed: READY in host RAM; the disk chunks unpinned
    the request's next lookup finds the prefix in host RAM and loads it like any other

A fetch that failed on any host forgets the disk chunk (it is never fetched again) and the request
is looked up as if the disk had nothing more: vLLM recomputes. One fetch per request admission.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from typing_extensions import override
import numpy as np

from tpuoffload import counters as C
from tpuoffload.backend.disk_tier import files_per_rank
from tpuoffload.messages import DISK_ROW, DiskBatch, DiskPlan, DiskReport, Range, pack_keys
from tpuoffload.manager.events import NO_EVENTS, ChunkEvents
from tpuoffload.manager.hash_table import HashKeys, PackedHashes
from tpuoffload.manager.index import ChunkIndex
from tpuoffload.manager.kv_groups import KVCacheGroups, chunk_keys
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.save_planner import SavePlanner
from tpuoffload.manager.tier import Tier

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from tpuoffload.manager.ledger import Resolved

_EMPTY_BATCH = DiskBatch()

logger = logging.getLogger(__name__)


class DiskIndex:
    """``events``: the sink of the disk's KV events (medium "STORAGE": a chunk every host's disk
    holds is READY in ``index``)."""

    def __init__(self, num_chunks: int | tuple[int, ...], num_hosts: int, counters: Counter[str],
                 clock: Callable[[], float], timeout_s: float, events: ChunkEvents = NO_EVENTS) -> None:
        """``num_chunks``: chunk files of each slot pool (an int: the KV pool's alone)."""
        pools = (num_chunks,) if isinstance(num_chunks, int) else tuple(num_chunks)
        num_chunks = sum(pools)
        self.num_pools = len(pools)
        # disk chunk number -> chunk, in the pools' ranges; its own counters
        self.index = ChunkIndex(num_chunks, events=events, pools=pools)
        self.ledger = CompletionLedger(num_hosts, source="disk tier")
        self.counters = counters
        self.clock = clock
        self.timeout_s = timeout_s
        self._keys = np.zeros((num_chunks, 2), np.uint64)  # what each disk chunk number holds ...
        self._held = np.zeros(num_chunks, bool)  # ... while this is set (the hosts may have its file)
        self._drops: list[np.ndarray] = []  # (n, 2) hash keys of chunk files the hosts must delete

    @staticmethod
    def capacity(disk_bytes: int, chunk_bytes: int, ranks: int = 1) -> int:
        """Chunk files this half keeps on each host (``ranks``: DP ranks, each with its own files;
        backend/disk_tier.py:files_per_rank, the rule the workers' tiers apply too)."""
        return files_per_rank(disk_bytes, chunk_bytes, ranks)

    # ---------------------------------------------------------------- spills
    def spill(self, slots: np.ndarray, save_ids: np.ndarray, keys: HashKeys, records, step: int,
              pools: np.ndarray | None = None) -> DiskBatch:
        """Chunks just evicted from host RAM go to disk (those not there already), with their event
        records (``ChunkIndex.take_evicted``); ``pools``: the slot pool of each (None: the KV
        pool), whose files take them (pool 0's chunks listed first)."""
        if not len(slots):
            return _EMPTY_BATCH
        events = self.index.events
        keys, new, _, _ = self.index.select_new(keys)
        slots, save_ids, records = slots[new], save_ids[new], events.subset(records, new)
        pools = np.zeros(len(slots), np.int8) if pools is None else np.asarray(pools, np.int8)[new]
        picked, taken = [], []
        for pool in range(self.num_pools):
            pos = np.flatnonzero(pools == pool)
            if len(pos):
                got = self.index.allocate(len(pos), pool)
                self._forget(got[self._held[got]])  # evicted from disk: the hosts delete them
                picked.append(pos[:len(got)])
                taken.append(got)
        n = sum(len(e) for e in taken)
        if not n:
            return _EMPTY_BATCH
        pos, entries = np.concatenate(picked), np.concatenate(taken)
        slots, save_ids, keys, pools = slots[pos], save_ids[pos], keys.take(pos), pools[pos]
        base = self.ledger.open_batch(entries, self.clock() + self.timeout_s, step)
        self.index.add_saving(keys, entries, base)
        events.copy_in(entries, events.subset(records, pos))
        self._keys[entries, 0], self._keys[entries, 1] = keys.k1, keys.k2
        self._held[entries] = True
        self.counters[C.SPILLS_ISSUED] += n
        return DiskBatch(tuple(slots.tolist()), tuple(save_ids.tolist()), range(base, base + n),
                         pack_keys(keys.k1, keys.k2), self._pools_bytes(pools))

    def _pools_bytes(self, pools: np.ndarray) -> bytes:
        """``DiskBatch.pools`` of these chunks (b"" with one pool)."""
        return pools.astype(np.int8).tobytes() if self.num_pools > 1 else b""

    def report(self, host: int, ok: tuple[Range, ...] = (), failed: tuple[Range, ...] = ()) -> None:
        self.ledger.report(host, ok=ok, failed=failed)

    def apply_resolved(self) -> None:
        self.ledger.expire(self.clock())
        res = self.ledger.take_resolved()
        if len(res.ready_ids):
            self.counters[C.SPILLS_CONFIRMED] += self.index.mark_ready(res.ready_slots, res.ready_ids)
        if len(res.dropped_ids):
            dropped = np.asarray(res.dropped_slots, dtype=np.int64)
            keep = self.index.save_ids(dropped) == res.dropped_ids
            self.index.drop(res.dropped_slots, res.dropped_ids)
            self._forget(dropped[keep])
            self.counters[C.SPILLS_DROPPED] += len(res.dropped_ids)

    def take_drops(self) -> DiskBatch:
        if not self._drops:
            return _EMPTY_BATCH
        rows = np.concatenate(self._drops)
        self._drops = []
        return DiskBatch(keys=pack_keys(rows[:, 0], rows[:, 1]), pools=self._pools_bytes(rows[:, 2]))

    def _forget(self, entries: np.ndarray) -> None:
        if len(entries):
            self._held[entries] = False
            pools = self.index.pool_of(entries).astype(np.uint64)[:, None]
            self._drops.append(np.concatenate([self._keys[entries], pools], axis=1))

    # ---------------------------------------------------------------- warm restart
    def adopt(self, kept: list[np.ndarray], blind: list[tuple[int, ...]] | None = None) -> tuple[int, int]:
        """Warm restart: the chunk files every host kept alike (``DISK_ROW`` rows of each host, least
        recently used first; the same pool included) become READY under the disk ids they were
        written with, each in its pool's entries, in the recency order of the first host that holds
        bytes of the pool; every other file a host kept is deleted on every host. ``blind[h]``: the
        pools of which host ``h`` holds no byte (it keeps no file of them, reads and writes none):
        it has no say on them, and a pool no host holds is adopted from nobody. Call before the
        first spill (no save is planned until the restore is settled). Returns (adopted, dropped)."""
        blind = blind or [()] * len(kept)
        alike = []
        for pool in range(self.num_pools):
            seeing = [rows[rows["pool"] == pool] for rows, b in zip(kept, blind) if pool not in b]
            common = seeing[0] if seeing else kept[0][:0]
            for rows in seeing[1:]:
                common = common[np.isin(_void(common), _void(rows))]
            alike.append(common)
        common = np.concatenate(alike)
        keys, valid = HashKeys.of_rows(common)
        common = common[valid]
        keys, keep, _, _ = self.index.select_new(keys)  # one entry per hash (invariant 5)
        common = common[keep]
        events = self.index.events
        records, described = events.lookup(keys)  # KV events: only files it can announce
        if not described.all():
            common, keys, records = common[described], keys.take(described), events.subset(records, described)
        free = np.flatnonzero(self.index.free_slots_mask(np.arange(self.index.num_slots)))
        free_pool = self.index.pool_of(free)
        picked, taken = [], []
        for pool in range(self.num_pools):
            pos, room = np.flatnonzero(common["pool"] == pool), free[free_pool == pool]
            pos = pos[max(0, len(pos) - len(room)):]  # the most recently used fit
            picked.append(pos)
            taken.append(room[:len(pos)])
        pos, entries = np.concatenate(picked), np.concatenate(taken)
        common, keys = common[pos], keys.take(pos)
        self.index.adopt(keys, entries, common["disk_id"], events.subset(records, pos))
        self._keys[entries, 0], self._keys[entries, 1] = keys.k1, keys.k2
        self._held[entries] = True
        offered = np.unique(_void(_file_keys(np.concatenate(kept))))
        others = offered[~np.isin(offered, _void(_file_keys(common)))]
        if len(others):
            self._drops.append(np.frombuffer(others.tobytes(), "<u8").reshape(-1, 3))
        return len(entries), len(others)

    # ---------------------------------------------------------------- fetches
    def start_fetch(self, entries: np.ndarray) -> np.ndarray:
        """Pin disk chunks for a fetch; their disk ids."""
        self.index.pin(entries)
        return self.index.save_ids(entries)

    def fetch_resolved(self, entry: int, disk_id: int, ok: bool) -> None:
        self.index.unpin(np.array([entry], dtype=np.int64))
        if not ok and self.index.discard(entry, disk_id):
            self._forget(np.array([entry], dtype=np.int64))

    def revoke_all(self) -> None:
        """A connector reset: nothing on disk is fetched again, and the hosts delete it all."""
        self._forget(np.flatnonzero(self._held))
        self.index.revoke_all()

    def leak_report(self) -> dict[str, int]:
        return {"disk_ledger_pending": len(self.ledger), "disk_pinned": self.index.num_pinned()}


def _void(rows: np.ndarray) -> np.ndarray:
    """Rows (structured, or of a 2-D array) as opaque byte strings, for whole-row set operations."""
    rows = np.ascontiguousarray(rows)
    size = rows.dtype.itemsize * (rows.shape[1] if rows.ndim == 2 else 1)
    return rows.view(np.dtype((np.void, size))).reshape(-1)


def _file_keys(rows: np.ndarray) -> np.ndarray:
    """(n, 3) uint64 (k1, k2, pool) of DISK_ROW rows: what names a chunk file on the hosts."""
    return np.stack([rows["k1"], rows["k2"], rows["pool"].astype(np.uint64)], axis=1)


_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class _Wanted:
    """What a request waits for: disk ``entries`` and their chunk ``keys`` (earliest block first),
    each chunk's slot pool (``pools``), and the keys of the host-RAM chunks of the hit they
    complete (``in_ram``)."""

    entries: np.ndarray
    keys: PackedHashes
    pools: np.ndarray
    in_ram: PackedHashes


class FetchPlanner:
    """Brings chunks back from disk into host RAM for requests that wait on the disk tier: per request
    the wanted chunks of its hit, claimed into host-RAM slots through ``SavePlanner.claim`` (a
    fetch is a save whose bytes come from disk), planned at most ``MAX_TRIES`` times without a
    free slot before giving up."""

    WANTED, IN_FLIGHT, DONE = 0, 1, 2
    MAX_TRIES = 8  # plans in which no host-RAM slot was free for a wanted fetch before giving up

    def __init__(self, saves: SavePlanner, disk: DiskIndex, block_size: int, counters: Counter[str],
                 forget_lookup: Callable[[str], object], groups: KVCacheGroups = KVCacheGroups()) -> None:
        self.saves = saves  # fetched chunks take host-RAM slots as saves do (SavePlanner.claim)
        self.ram, self.disk = saves.index, disk
        self.block_size = block_size
        self.groups = groups  # vLLM's KV cache groups: a hit is one every group can serve
        self.counters = counters
        self._forget_lookup = forget_lookup
        self._state: dict[str, int] = {}
        self._wanted: dict[str, _Wanted] = {}  # req -> what it waits for
        self._by_save_id: dict[int, tuple[str, int, int]] = {}  # RAM save id -> (req, disk entry, disk id)
        self._left: Counter[str] = Counter()  # req -> fetched chunks not resolved yet
        self._tries: Counter[str] = Counter()  # req -> plans that found no slot for its fetch
        self._held: dict[str, np.ndarray] = {}  # req -> host-RAM slots pinned while its fetch is in flight

    def wants(self, request: "Request", local_blocks: int, ram_hits: int) -> bool:
        """True while the request should wait for chunks coming back from disk (vLLM: None)."""
        rid = request.request_id
        state = self._state.get(rid)
        if state is not None:
            return state != self.DONE
        limit = (request.num_tokens - 1) // self.block_size
        wanted = self._wanted_chunks(request.block_hashes, local_blocks, ram_hits, limit)
        if wanted is None:
            return False
        self._wanted[rid] = wanted
        self._state[rid] = self.WANTED
        return True

    def _wanted_chunks(self, hashes, local: int, ram_hits: int, limit: int) -> "_Wanted | None":
        """The disk chunks that lengthen the request's host-RAM hit of ``ram_hits`` blocks after
        its ``local`` ones (earliest block first), and the host-RAM chunks of the hit they complete;
        None if there are none. The hit is the longest every KV cache group can serve from host RAM
        and disk together (``KVCacheGroups.hit_length``: a full-attention group all its blocks, a
        sliding-window group its window's), and each group's chunks of it that host RAM lacks come
        back."""
        start = local + ram_hits
        if limit <= start or not self._may_continue(hashes[start]):
            return None
        span = hashes[local:limit]
        in_ram = [slots >= 0 for slots in self.groups.ready_slots(self.ram, span)]
        on_disk = self.groups.ready_slots(self.disk.index, span)
        n = self.groups.hit_length([r | (d >= 0) for r, d in zip(in_ram, on_disk)])
        if n <= ram_hits:
            return None
        first = np.array(self.groups.first_blocks(n))
        part = np.arange(n)[:, None] >= first  # (block, group): the hit's chunks
        ram = np.stack([r[:n] for r in in_ram], axis=1)
        packed = PackedHashes.of(span[:n])
        keys = np.stack([np.frombuffer(chunk_keys(packed, g).buf, np.uint8).reshape(n, packed.width)
                         for g in range(self.groups.num)], axis=1)  # (block, group, width)
        disk = np.stack([d[:n] for d in on_disk], axis=1)

        def pick(mask: np.ndarray) -> PackedHashes:  # block by block, so a cut keeps early prefixes
            return PackedHashes(keys[mask].tobytes(), packed.width)

        pools = np.broadcast_to(self.groups.pool_of_groups(), part.shape)[part & ~ram]
        return _Wanted(disk[part & ~ram].astype(np.int64), pick(part & ~ram), pools, pick(part & ram))

    def _may_continue(self, block_hash: bytes) -> bool:
        """One probe (the usual answer): a longer hit needs the block after the host-RAM hit, so
        its probe chunk (``KVCacheGroups.probe_key``) must be in host RAM or on disk."""
        key = self.groups.probe_key(block_hash)
        return key is None or self.disk.index.ready_slot(key) >= 0 or self.ram.ready_slot(key) >= 0

    def plan(self, step: int) -> DiskBatch:
        """Fetches wanted since the last plan (call with the step's loads pinned). The host-RAM
        chunks of the hit a fetch completes stay pinned until it resolves: its own claim, or any
        save meanwhile, would otherwise evict them (they are often the least recently used)."""
        if not self._wanted:
            return DiskBatch()
        slots_out, ids_out, disk_out, keys_out, pools_out = [], [], [], [], []
        retry: dict[str, _Wanted] = {}
        for rid, wanted in self._wanted.items():
            entries, packed = wanted.entries, wanted.keys
            keys = HashKeys.of(packed)
            # Still on disk, and not in host RAM meanwhile (saved again, or another fetch).
            ok = (self.disk.index.find(keys) == entries) & (self.ram.find(keys) < 0)
            n = len(ok) if ok.all() else int(ok.argmin())
            held = self.ram.ready_slots(HashKeys.of(wanted.in_ram))
            held = held[held >= 0]
            self.ram.pin(held)
            # Each chunk into a slot of its own pool (a state chunk into the state pool).
            claim = self.saves.claim_pools(PackedHashes(packed.buf[:n * packed.width], packed.width),
                                           wanted.pools[:n], step)
            slots = claim.slots
            if not len(slots):
                self.ram.unpin(held)
                # Host RAM is all saving or pinned right now: try again next step, a few times.
                self._tries[rid] += 1
                if n and self._tries[rid] < self.MAX_TRIES:
                    retry[rid] = wanted
                else:
                    self._state[rid] = self.DONE
                continue
            self._held[rid] = held
            n, base, keys = len(slots), claim.first_save_id, claim.keys
            entries = entries[claim.keep]  # the chunks are distinct and new: each pool's a prefix of its own
            pools_out.append(wanted.pools[claim.keep])
            self.ram.events.copy_in(slots, self.disk.index.events.rows(entries))  # KV events: their records
            disk_ids = self.disk.start_fetch(entries)
            for i in range(n):
                self._by_save_id[base + i] = (rid, int(entries[i]), int(disk_ids[i]))
            self._left[rid] += n
            self._state[rid] = self.IN_FLIGHT
            slots_out.append(slots)
            ids_out.append(np.arange(base, base + n))
            disk_out.append(disk_ids)
            keys_out.append(pack_keys(keys.k1, keys.k2))
            self.counters[C.FETCHES_ISSUED] += n
        self._wanted = retry
        if not slots_out:
            return DiskBatch()
        return DiskBatch(tuple(np.concatenate(slots_out).tolist()), tuple(np.concatenate(ids_out).tolist()),
                         tuple(np.concatenate(disk_out).tolist()), b"".join(keys_out),
                         self.disk._pools_bytes(np.concatenate(pools_out)))

    def resolved(self, ready_ids: np.ndarray, dropped_ids: np.ndarray) -> None:
        """RAM saves resolved: those that were fetches unpin their disk chunks."""
        if not self._by_save_id:
            return
        for ids, ok in ((ready_ids, True), (dropped_ids, False)):
            for sid in ids.tolist():
                hit = self._by_save_id.pop(sid, None)
                if hit is None:
                    continue
                rid, entry, disk_id = hit
                self.disk.fetch_resolved(entry, disk_id, ok)
                if not ok:
                    self.counters[C.FETCHES_FAILED] += 1
                self._left[rid] -= 1
                if self._left[rid] <= 0:
                    del self._left[rid]
                    self.ram.unpin(self._held.pop(rid, _NONE))
                    if rid in self._state:
                        self._state[rid] = self.DONE
                        self._forget_lookup(rid)  # the next lookup sees the fetched chunks

    def forget(self, rid: str) -> None:
        """The request finished or was admitted: its next admission may fetch again."""
        self._state.pop(rid, None)
        self._wanted.pop(rid, None)
        self._tries.pop(rid, None)

    def clear(self) -> None:
        """A connector reset: nothing wanted is fetched (fetches in flight still resolve)."""
        self._wanted.clear()
        self._state = {rid: s for rid, s in self._state.items() if s == self.IN_FLIGHT}

    def num_in_flight(self) -> int:
        return len(self._by_save_id)


class DiskTierPlanner(Tier):
    """The disk tier as a ``Tier``: spills what host RAM evicts, fetches prefixes that continue on
    disk back into host RAM, and, with warm restart, indexes again the chunk files every host kept.

    Warm restart: every host reports the files it kept once (``DiskReport.kept``, repeated while
    ``DiskPlan.waiting``); until every host did, or ``timeout_s`` passed, no save is planned (a
    spill could take a kept file's disk id). Then the files every host that holds bytes of their
    pool kept alike become fetchable and the rest is deleted everywhere (``DiskIndex.adopt``); if
    the reports never all come, or a reset comes first, nothing is adopted and a reset deletes
    every file.
    """

    name = "disk"

    def __init__(self, disk: DiskIndex, fetches: FetchPlanner, ram: ChunkIndex, num_hosts: int,
                 counters: Counter[str], clock: Callable[[], float], timeout_s: float, keeps_files: bool) -> None:
        self.disk, self.fetches, self.ram = disk, fetches, ram
        self.num_hosts = num_hosts
        self.counters = counters
        self.clock = clock
        # host -> (its kept files as DISK_ROW rows, the pools of which it holds no byte); None: settled
        self._kept: dict[int, tuple[np.ndarray, tuple[int, ...]]] | None = {} if keeps_files else None
        self._kept_deadline = clock() + timeout_s
        self.timeout_s = timeout_s
        self._fetch = _EMPTY_BATCH
        self._delete_all = False
        ram.record_evictions()

    @property
    @override
    def blocks_saves(self) -> bool:
        return self._kept is not None

    @override
    def wants(self, request: "Request", local_blocks: int, ram_hits: int) -> bool:
        return self.fetches.wants(request, local_blocks, ram_hits)

    @override
    def forget(self, req_id: str) -> None:
        self.fetches.forget(req_id)

    @override
    def start_step(self, step: int) -> None:
        if self._kept is not None and self.clock() > self._kept_deadline:
            self.counters[C.DISK_RESTORED_DROPPED] += max((len(r) for r, _ in self._kept.values()), default=0)
            self._kept = None  # never adopted: the files are evicted first, a reset deletes them

    @override
    def plan_into_ram(self, step: int) -> None:
        self._fetch = self.fetches.plan(step)

    @override
    def finish_step(self, step: int) -> DiskPlan | None:
        """What this plan evicted from host RAM goes to disk first."""
        self.disk.apply_resolved()
        slots, save_ids, keys, records = self.ram.take_evicted()
        spill = self.disk.spill(slots, save_ids, keys, records, step, self.ram.pool_of(slots))
        drop, fetch, self._fetch = self.disk.take_drops(), self._fetch, _EMPTY_BATCH
        delete_all, self._delete_all = self._delete_all, False
        waiting = self._kept is not None
        if not (len(drop) or len(spill) or len(fetch) or delete_all or waiting):
            return None
        return DiskPlan(drop, spill, fetch, delete_all, waiting)

    @override
    def on_report(self, parts: dict[int, DiskReport]) -> None:
        for host, part in parts.items():
            if part.saved or part.failed:
                self.disk.report(host, ok=part.saved, failed=part.failed)
            if self._kept is not None and part.kept is not None and 0 <= host < self.num_hosts:
                self._kept[host] = (np.frombuffer(part.kept, DISK_ROW), part.blind)
        if self._kept is not None and len(self._kept) == self.num_hosts:
            rows, blind = zip(*(self._kept[h] for h in range(self.num_hosts)))
            adopted, dropped = self.disk.adopt(list(rows), list(blind))
            self._kept = None
            self.counters[C.DISK_RESTORED_READY] += adopted
            self.counters[C.DISK_RESTORED_DROPPED] += dropped
            logger.info("tpuoffload disk tier: %d chunk files on disk fetchable (%d deleted: not kept alike by "
                        "every host)", adopted, dropped)

    @override
    def on_resolved(self, resolved: "Resolved") -> None:
        self.fetches.resolved(resolved.ready_ids, resolved.dropped_ids)

    @override
    def reset(self, next_save_id: int) -> None:
        """Nothing on disk is fetched again, and every host deletes every chunk file."""
        self.disk.revoke_all()
        self.fetches.clear()
        self._kept = None
        self._delete_all = True

    @override
    def leak_report(self) -> dict[str, int]:
        return self.disk.leak_report()
