"""Messages between the scheduler half and the worker halves, one of each per engine step.

``OffloadMetadata`` crosses the network to every host every step, so it is kept compact: a save
batch's save ids are one ``range`` (the scheduler hands them out contiguously), its slots a
``range`` when they are consecutive (usually) or else a tuple, block ids are tuples of ints. ``metadata_bytes`` measures it the way vLLM's executors ship it (pickle).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override
import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

Range = tuple[int, int]  # [start, stop)


@dataclass(frozen=True)
class SaveBatch:
    """Chunks to copy from KV-cache blocks into host slots (position i of each sequence is chunk i).
    ``save_ids`` is a ``range`` when built by the scheduler, ``slots`` a ``range`` or a tuple (any
    int sequence is accepted)."""

    block_ids: Sequence[int] = ()
    slots: Sequence[int] = ()
    save_ids: Sequence[int] = ()
    # The chunks' hash keys, (k1, k2) little-endian uint64 pairs, one per chunk; only with warm
    # restart on (16 bytes per chunk): each host keeps them per slot, so a checkpoint, written by
    # the hosts alone at shutdown, holds what the index needs at the next start.
    keys: bytes = b""

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class DiskBatch:
    """Chunks moving between host RAM and the disk tier (``keys``: as in ``SaveBatch``).

    As a spill: the chunks just evicted from ``slots`` (which must still hold ``save_ids``), to be
    copied to disk under ``disk_ids`` before this step's saves reuse the slots. As a fetch: the
    disk chunks ``disk_ids`` to read back in the background and write into ``slots`` under the
    new ``save_ids`` at the start of the next step. As drops: disk chunks to delete (keys and
    pools only).

    ``pools``: each chunk's slot pool (one int8 each; b"": every chunk the KV pool's), the one
    thing that says which pool a chunk file holds: its directory and chunk size on the workers
    (worker/disk_stage.py) and, for a spill or a fetch, which host store its slot is in.
    """

    slots: Sequence[int] = ()
    save_ids: Sequence[int] = ()
    disk_ids: Sequence[int] = ()
    keys: bytes = b""
    pools: bytes = b""

    def __len__(self) -> int:
        return len(self.keys) // 16

    def pool_of(self) -> np.ndarray:
        """Each chunk's slot pool (int8)."""
        return np.frombuffer(self.pools, np.int8) if self.pools else np.zeros(len(self), np.int8)


@dataclass(frozen=True)
class LoadRequest:
    """One request's prefix hit: host slots to copy into its blocks. ``unavailable_block_ids`` are
    blocks the scheduler promised but could not pin; workers report them as load errors.

    Slots and save ids are the planning scheduler's own (``StepPlan.placement`` moves them). Under
    DPScheduler a hit may read another DP rank's chunk: it is named by its offset from the planning
    rank's own range (rank q's slot s from rank r: ``s + (q - r) * num_slots``, save id
    ``i + ((q - r) << RANK_SAVE_ID_SHIFT)``), so the placement lands it in rank q's range."""

    req_id: str
    block_ids: tuple[int, ...]
    slots: Sequence[int]  # a range when consecutive (usually), else a tuple
    save_ids: Sequence[int]  # likewise
    unavailable_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class DiskPlan:
    """The disk tier's part of a step plan (manager/disk_index.py plans it, worker/disk_stage.py
    executes it): chunks to delete from disk, to copy there (evicted from host RAM in this plan), to
    bring back into host RAM (written into their slots at the start of the next step)."""

    drop: DiskBatch = field(default_factory=DiskBatch)
    spill: DiskBatch = field(default_factory=DiskBatch)
    fetch: DiskBatch = field(default_factory=DiskBatch)
    # A connector reset: every chunk file goes, also files kept from an earlier start.
    delete_all: bool = False
    # Warm restart: the manager still waits for the files each host kept (hosts repeat them).
    waiting: bool = False


@dataclass(frozen=True)
class PersistPlan:
    """Warm restart's part of a step plan (manager/restart.py, worker/persistence.py)."""

    # Write a checkpoint of every host's slots at the start of this step.
    checkpoint: bool = False
    # The manager still waits for restore rows or checkpoint outcomes: hosts repeat theirs (a report
    # lost on the way only delays them).
    waiting: bool = False
    # A connector reset: every chunk saved under a save id below this is gone for good, also from the
    # checkpoints written after this step (and saves still in flight never become restorable).
    revoke_below: int | None = None


@dataclass(frozen=True)
class SharedPlan:
    """The shared tier's part of a step plan (manager/shared_tier.py plans it, worker/shared_stage.py
    executes it on every host; each host touches only its own shard's objects). ``scope``: the
    scheduler's part of the objects' namespace (vLLM's block-hash seed)."""

    scope: str = ""
    # Hosts of the engine (the scheduler's count of reporting workers): each object names its shard
    # as "host i of hosts".
    hosts: int = 1
    # Every object is named by a chunk's content key (vLLM's block hash: ``keys``, 16 bytes each)
    # and its KV cache group (``groups``: one uint8 per chunk; b"": every chunk group 0's), as
    # vLLM's offload key is a block hash and a group.
    # (probe id, keys, groups, pools): does this host's store hold (and would it verify) each chunk?
    # ``pools``: each chunk's host slot pool (one int8 each; b"": every chunk the KV pool's), as
    # ``DiskBatch.pools`` names them in ``publish`` and ``fetch``.
    probe: tuple[tuple[int, bytes, bytes, bytes], ...] = ()
    # READY chunks to read out of their host-RAM slots (still holding ``save_ids``) and publish
    # (``publish.keys``: content keys), of groups ``publish_groups``.
    publish: DiskBatch = field(default_factory=DiskBatch)
    # Chunks to read from the store in the background and verify, then hold: host-RAM ``slots``
    # claimed under ``save_ids`` (a save whose bytes come from the store), of groups ``fetch_groups``.
    fetch: DiskBatch = field(default_factory=DiskBatch)
    # Save ids of held fetches that every host verified: written into their slots now.
    install: tuple[int, ...] = ()
    # Save ids of held fetches that some host could not verify (or did not in time): dropped.
    cancel: tuple[int, ...] = ()
    publish_groups: bytes = b""
    fetch_groups: bytes = b""


#: One chunk in ``ChunkNews.ready``: the rank's own slot and save id, and the hash key words.
NEWS_READY_ROW = np.dtype([("slot", "<i8"), ("save_id", "<i8"), ("k1", "<u8"), ("k2", "<u8")])
#: One chunk in ``ChunkNews.gone``: the rank's own slot and the save id it held.
NEWS_GONE_ROW = np.dtype([("slot", "<i8"), ("save_id", "<i8")])


@dataclass(frozen=True)
class ChunkNews:
    """Under DPScheduler: what changed in one rank's set of READY chunks since its last plan, for
    the other ranks' read-only views (manager/rank_view.py). It travels in the rank's plan, and
    every host echoes it in its report, which DPScheduler hands to every rank. ``epoch``: the
    rank's connector resets so far (news from before a reset is stale)."""

    epoch: int = 0
    ready: bytes = b""  # NEWS_READY_ROW rows
    gone: bytes = b""  # NEWS_GONE_ROW rows

    def __bool__(self) -> bool:
        return bool(self.ready or self.gone)


@dataclass
class StepPlan:
    """One scheduler half's plan for one step; workers act on nothing else.

    Block ids and slots are the planning scheduler's own. With one vLLM scheduler they are the
    engine's; under tpu-inference's ``DPScheduler`` each DP rank's scheduler plans over its own
    ``num_blocks`` blocks and ``num_slots`` slots, and the workers place them (``placement``).
    """

    step: int
    num_slots: int
    # Blocks computed in earlier steps whose owner was preempted or finished (lazy mode): gathered
    # before this step's forward, since vLLM may already have handed the blocks to another request.
    flush: SaveBatch = field(default_factory=SaveBatch)
    # Blocks that this step's forward fills: gathered after the forward is launched.
    save: SaveBatch = field(default_factory=SaveBatch)
    loads: tuple[LoadRequest, ...] = ()
    # Finished requests whose blocks vLLM holds for us until this step's saves are dispatched.
    release_req_ids: tuple[str, ...] = ()
    # The tiers beside host RAM (manager/tier.py): each tier's part of the plan under its name
    # (``DiskPlan`` under "disk", ``PersistPlan`` under "persist"); absent when a tier has nothing.
    tiers: dict[str, Any] = field(default_factory=dict)
    # Who planned it: the scheduler half's ``source`` (its reports come back under it).
    source: int = 0
    # Blocks of the planning scheduler's KV cache (0: the engine's whole cache).
    num_blocks: int = 0
    # Load failures go to vLLM by request (``failed_recving``), never by block id: with several KV
    # cache groups block ids are unique only within a group, and under DPScheduler they are
    # rank-local while every rank's scheduler reads every failure (topology.DPRank).
    failures_by_request: bool = False
    # DPScheduler's merge adds ``rank * num_blocks`` to every entry of a plan's
    # ``local_block_ids``: this one entry, 0 when planned, tells the workers where the rank's
    # blocks start in the engine's cache. The DP scheduler's own translation, so it cannot drift.
    local_block_ids: list[int] = field(default_factory=lambda: [0])
    # DPScheduler: this rank's READY chunks that came and went since its last plan (the workers
    # echo it to every rank).
    news: ChunkNews = field(default_factory=ChunkNews)
    # The last ``state_slots`` of the ``num_slots`` slots are the state pool's: GDN/mamba state
    # rows, kept in the workers' second store (worker/pooled_engine.py); 0: one pool (KV chunks).
    state_slots: int = 0
    # Under DPScheduler with a state pool: the planning rank's rows of tpu-inference's compact
    # state pool (DPScheduler gives each rank ``mamba_num_blocks // ranks``); its state row ``b``
    # is the engine's row ``rank * state_rows + b`` (the pool splits over the ranks along axis 0,
    # as the attention blocks do). 0: one scheduler, whose state rows are the engine's.
    state_rows: int = 0

    def placement(self) -> tuple[int, int, int]:
        """(block offset, slot offset, save id offset) of this plan in the engine's numbering: a DP
        rank's blocks start where DPScheduler put them; its slots are its batch shard's (the store
        rows of that shard's devices, worker/programs.py) and its save ids a range of its own
        (rank = block offset // num_blocks)."""
        block_offset = self.local_block_ids[0]
        rank = block_offset // self.num_blocks if self.num_blocks else 0
        return block_offset, rank * self.num_slots, rank << RANK_SAVE_ID_SHIFT


#: A DP rank's save ids are offset by ``rank << RANK_SAVE_ID_SHIFT`` in the engine (ranks plan
#: their own ids from 0; no rank plans 2**40 saves).
RANK_SAVE_ID_SHIFT = 40


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """What vLLM hands every worker each step: the plans of every scheduler half.

    One vLLM scheduler sends one plan. tpu-inference's ``DPScheduler`` (data parallelism) runs one
    scheduler per DP rank and merges their metadata by duck typing: ``type(meta)()``, then it
    extends ``requests_meta`` (translating each entry's ``local_block_ids``) and drops every other
    field. So the plans live in ``requests_meta`` under that name, and this class has a no-argument
    constructor. Workers execute the plans in list order, the same on every host.
    """

    requests_meta: list[StepPlan] = field(default_factory=list)

    @property
    def plan(self) -> StepPlan:
        """The one plan of a single scheduler's metadata."""
        if len(self.requests_meta) != 1:
            raise ValueError(f"metadata carries {len(self.requests_meta)} plans, not one")
        return self.requests_meta[0]


def metadata_bytes(meta: OffloadMetadata) -> int:
    """Size of ``meta`` as pickled for the workers (the highest protocol, as vLLM's executors)."""
    return len(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))


# ---------------------------------------------------------------------------- save id ranges
def id_ranges(ids: Iterable[int]) -> tuple[Range, ...]:
    """The sorted, disjoint, non-adjacent ``[start, stop)`` ranges that cover exactly ``ids``."""
    a = np.unique(np.fromiter(ids, dtype=np.int64))
    if not len(a):
        return ()
    breaks = np.flatnonzero(np.diff(a) != 1) + 1
    starts = a[np.concatenate(([0], breaks))]
    stops = a[np.concatenate((breaks - 1, [len(a) - 1]))] + 1
    return tuple(zip(starts.tolist(), stops.tolist()))


def merge_ranges(a: Sequence[Range], b: Sequence[Range]) -> tuple[Range, ...]:
    """Union of two range lists (sorted, disjoint, non-adjacent on output)."""
    if not a:
        return tuple(b)
    if not b:
        return tuple(a)
    out: list[list[int]] = []
    for start, stop in sorted((*a, *b)):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return tuple((s, e) for s, e in out)


def _merge_maps(x: dict, y: dict) -> dict:
    out = dict(x)
    for host, ranges in y.items():
        out[host] = merge_ranges(out.get(host, ()), ranges)
    return out


@dataclass
class OffloadWorkerReport(KVConnectorWorkerMetadata):
    """Save outcomes of one or more hosts: ``saved[source, host]`` and ``failed[source, host]`` are
    ranges of the save ids that scheduler half ``source`` planned (``StepPlan.source``). Merging is
    a union per key, so a report merged twice counts once (idempotent, order-free) while the same
    save confirmed by two hosts stays two confirmations. Under DPScheduler every rank's scheduler
    receives the whole report and reads only its own source's entries.

    Build one with ``OffloadWorkerReport.from_host(host, saved_ids, failed_ids)``; the scheduler's
    ledger applies a range with a few array operations, not per save id.
    """

    saved: dict[tuple[int, int], tuple[Range, ...]] = field(default_factory=dict)
    failed: dict[tuple[int, int], tuple[Range, ...]] = field(default_factory=dict)
    # The tiers beside host RAM: each tier's part of each host's report for the scheduler half
    # ``source`` that planned it, ``tiers[name][source, host]`` (``DiskReport``, ``PersistReport``;
    # under DPScheduler each rank's tier reports to its own half), merged per key by the part's own
    # ``merge``.
    tiers: dict[str, dict[tuple[int, int], Any]] = field(default_factory=dict)
    # Under DPScheduler: the DP rank of each scheduler half (source -> rank), as the workers placed
    # its plans, so a half can name itself in its stats file and logs.
    ranks: dict[int, int] = field(default_factory=dict)
    # Under DPScheduler: each rank's ``StepPlan.news``, echoed, by (rank, step); every host echoes
    # the same, so the union is idempotent.
    news: dict[tuple[int, int], ChunkNews] = field(default_factory=dict)

    @classmethod
    def from_host(cls, host: int, saved_ids: Iterable[int] = (), failed_ids: Iterable[int] = (),
                  source: int = 0) -> "OffloadWorkerReport":
        saved, failed = id_ranges(saved_ids), id_ranges(failed_ids)
        key = (source, host)
        return cls({key: saved} if saved else {}, {key: failed} if failed else {})

    def outcomes(self, source: int) -> Iterable[tuple[int, tuple[Range, ...], tuple[Range, ...]]]:
        """(host, saved ranges, failed ranges) of the saves ``source`` planned."""
        for src, host in set(self.saved) | set(self.failed):
            if src == source:
                yield host, self.saved.get((src, host), ()), self.failed.get((src, host), ())

    def tier_parts(self, name: str, source: int) -> dict[int, Any]:
        """Tier ``name``'s part of each host's report for the half ``source`` (host -> part)."""
        return {host: part for (src, host), part in self.tiers.get(name, {}).items() if src == source}

    def __len__(self) -> int:
        """Save outcomes carried (a host's confirmation of a save counts one)."""
        return sum(b - a for m in (self.saved, self.failed) for rs in m.values() for a, b in rs)

    def __bool__(self) -> bool:
        """True if it carries anything. vLLM's KVOutputAggregator drops a falsy report (``elif
        meta := ...`` and ``... or None``), so a report of restored chunks or checkpoints only,
        whose ``len`` is 0, must still be true."""
        return bool(self.hosts() or self.ranks or self.news)

    def hosts(self) -> set[int]:
        return ({host for _, host in self.saved} | {host for _, host in self.failed}
                | {host for parts in self.tiers.values() for _, host in parts})

    @override
    def aggregate(self, other: KVConnectorWorkerMetadata) -> "OffloadWorkerReport":
        """Invariant 7: a union per host, idempotent and order-free (vLLM's KVOutputAggregator
        merges the workers' reports with it)."""
        assert isinstance(other, OffloadWorkerReport), type(other)
        tiers = {name: dict(parts) for name, parts in self.tiers.items()}
        for name, parts in other.tiers.items():
            mine = tiers.setdefault(name, {})
            for key, part in parts.items():
                mine[key] = mine[key].merge(part) if key in mine else part
        return OffloadWorkerReport(_merge_maps(self.saved, other.saved), _merge_maps(self.failed, other.failed),
                                   tiers, {**self.ranks, **other.ranks}, {**self.news, **other.news})


@dataclass(frozen=True)
class DiskReport:
    """One host's disk-tier news: spills written or failed (ranges of disk ids) and, with warm
    restart, the chunk files it kept at start-up (``DISK_ROW`` rows, least recent first) and the
    slot pools of which it holds no byte (``blind``: under DPScheduler, a rank whose batch shard
    has no device on this host; its kept rows say nothing about those pools)."""

    saved: tuple[Range, ...] = ()
    failed: tuple[Range, ...] = ()
    kept: bytes | None = None
    blind: tuple[int, ...] = ()

    def merge(self, other: "DiskReport") -> "DiskReport":
        first = self if self.kept is not None else other
        return DiskReport(merge_ranges(self.saved, other.saved), merge_ranges(self.failed, other.failed),
                          first.kept, first.blind)


@dataclass(frozen=True)
class PersistReport:
    """One host's warm-restart news: the chunks it restored at start-up (``RESTORED_ROW`` rows, b""
    when it started cold) and the checkpoints it resolved ((planned step, number, ok), ...)."""

    restored: bytes | None = None
    checkpoints: tuple[tuple[int, int, bool], ...] = ()

    def merge(self, other: "PersistReport") -> "PersistReport":
        return PersistReport(self.restored if self.restored is not None else other.restored,
                             tuple(sorted(set(self.checkpoints) | set(other.checkpoints))))


@dataclass(frozen=True)
class SharedReport:
    """One host's shared-tier news: probe answers ((probe id, one byte per key: 1 when this host's
    object exists), ...) and the fetches it read and verified, or could not (ranges of save ids)."""

    probed: tuple[tuple[int, bytes], ...] = ()
    fetched: tuple[Range, ...] = ()
    fetch_failed: tuple[Range, ...] = ()

    def merge(self, other: "SharedReport") -> "SharedReport":
        return SharedReport(tuple(sorted(set(self.probed) | set(other.probed))),
                            merge_ranges(self.fetched, other.fetched), merge_ranges(self.fetch_failed, other.fetch_failed))


# ---------------------------------------------------------------------------- warm restart rows
#: Save id of a chunk restored from a checkpoint into slot s of the KV pool: RESTORED_BASE + s (the
#: scheduler's own ids count up from 0 and never get there); into slot s of slot pool p (a GDN/mamba
#: state pool: its own slot numbering, from 0): ``restored_save_id(p, s)``.
RESTORED_BASE = 1 << 62
#: Restored save ids of pool p start at RESTORED_BASE + (p << RESTORED_POOL_SHIFT) (above every DP
#: rank's offset, RANK_SAVE_ID_SHIFT).
RESTORED_POOL_SHIFT = 60
#: One restored chunk as a host reports it: slot (in its pool's own numbering), the save id it was
#: checkpointed under, k1, k2, and its slot pool (0: KV, 1: GDN/mamba state).
RESTORED_ROW = np.dtype([("slot", "<i8"), ("save_id", "<i8"), ("k1", "<u8"), ("k2", "<u8"), ("pool", "<i8")])


def restored_save_id(pool, slot):
    """The save id a chunk restored into ``slot`` of slot pool ``pool`` is known by on the hosts and
    in the scheduler's index (ints or arrays)."""
    return RESTORED_BASE + (pool << RESTORED_POOL_SHIFT) + slot
#: One chunk file a host's disk tier kept at start-up: the disk id it was written under, k1, k2,
#: and the slot pool whose chunk it holds (the directory it was found in).
DISK_ROW = np.dtype([("disk_id", "<i8"), ("k1", "<u8"), ("k2", "<u8"), ("pool", "<i8")])


def pack_keys(k1: np.ndarray, k2: np.ndarray) -> bytes:
    """``SaveBatch.keys`` of the chunks with hash keys ``k1``/``k2``."""
    return np.stack([k1, k2], axis=1).astype("<u8").tobytes()


def unpack_keys(keys: bytes) -> np.ndarray:
    """(n, 2) uint64 hash keys of ``SaveBatch.keys``."""
    return np.frombuffer(keys, dtype="<u8").reshape(-1, 2)


def compact_ints(values: np.ndarray, run_step: int | None = None) -> Sequence[int]:
    """``values`` as a ``range`` when they are consecutive, ascending or descending (the usual
    case for slots: a fresh pool hands them out ascending, and the LRU victims of one earlier
    batch come out descending), else as a tuple. Either pickles compactly for the workers, and a
    range costs neither a per-element conversion here nor bytes per element on the wire.
    ``run_step``: the caller's answer already (as ``ChunkIndex.add_saving`` and ``ready_prefix_saved`` find it)."""
    if len(values) < 2:
        return tuple(values.tolist())
    if run_step is None:
        from tpuoffload.manager.kernels import kernels  # (numba: only the scheduler half needs it)

        run_step = kernels().run_step(values)
    if run_step:
        first = int(values[0])
        return range(first, first + run_step * len(values), run_step)
    return tuple(values.tolist())
