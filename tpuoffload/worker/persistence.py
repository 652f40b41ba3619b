"""Warm restart, the worker's side: restore this host's slots at start-up, checkpoint them on demand.

A checkpoint is written by the hosts alone: every slot's row holds what the scheduler's index needs
at the next start (the save id, the block it was gathered from, and the chunk's hash keys, which
``SaveBatch.keys`` brings), so the checkpoint taken at shutdown -- when vLLM has already stopped
stepping, and tears the workers down before the scheduler -- is as complete as one planned in a step.

Restore (``restore``, in ``register_runner``, before the first step, on every host alike): the
newest complete checkpoint that every host accepts (``Persister.restore``: fingerprint, slot
layout, checksums) replaces the zeroed stores and the slot table. With the disk tier, its chunk
files written under the same fingerprint are kept too (the disk tier reports those). Each restored chunk's save id
becomes ``restored_save_id(pool, slot)`` (``RESTORED_BASE + slot`` in the KV pool): unique, never
issued by the new scheduler (whose ids start at 0), and the same on every host that restored that
slot. The host reports its restored rows (``RESTORED_ROW``: slot, old save id, hash keys, slot
pool) once, in its first report; the scheduler makes loadable only the chunks every host restored
identically, each in its own pool (manager/restart.py).

Slot pools. A GDN/mamba hybrid's host RAM is two stores (worker/pooled_engine.py): the KV pool's
and the state pool's, each with its own slot table. A checkpoint holds both (the state pool as the
Persister's further pool, ``PoolSlots``), each pool's slot table, keys and checksums its own, and
a restored state chunk goes back into the state store's slot it was saved from, never the KV
store's: its row names the pool, and its slot is the state store's own. The saves name state
slots in the engine's numbering, from the step's first state slot (``state_slot``) on.

Checkpoint (``checkpoint``, main thread, at a step the scheduler planned or at ``close``, the same
point on every host): the background saves are drained first so every tag is final, then
``Persister.save`` writes the stores as they are (no copy) and the table. Until it resolves no
store may be donated, so a save that arrives meanwhile waits for it (``before_donate``); the
scheduler plans no saves until every host reported the checkpoint, so in practice nothing waits.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import weakref
from collections import Counter
from dataclasses import dataclass

from typing_extensions import override
import numpy as np

from tpuoffload.backend.slot_table import EMPTY_SLOT
from tpuoffload.layout import CacheLayout
from collections.abc import Callable, Sequence

from tpuoffload.messages import (RANK_SAVE_ID_SHIFT, RESTORED_ROW, PersistPlan, PersistReport, SaveBatch,
                                 restored_save_id, unpack_keys)
from tpuoffload.persist import Fingerprint, PersistFaults, Persister, PoolSlots, SaveHandle
from tpuoffload.worker.tier import Placement, WorkerTier
from tpuoffload.worker.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)

_COLUMNS = ("save_id", "source_block", "k1", "k2")  # one checkpointed slot row, int64 each


@dataclass(frozen=True)
class Deployment:
    """What a checkpoint must match besides the cache layout (the worker cannot see these)."""

    model: str = ""
    block_size: int = 0


def _groups(layout: CacheLayout) -> str:
    return "; ".join(f"{len(g.layers)} layers of {g.shape[1:]} {g.dtype} sharded {g.sharding.spec}, "
                     f"{g.num_shards} block shard(s)" for g in layout.groups)


def fingerprint(layout: CacheLayout, deployment: Deployment, num_hosts: int,
                state: CacheLayout | None = None) -> Fingerprint:
    """What a checkpoint of this deployment is checked against: the model, every layer group's
    block shape, dtype and sharding (not the number of blocks in HBM, which may change freely), the
    block size, the hosts, the bytes of a slot and the DP ranks (batch shards) the slots are split
    over; with a GDN/mamba state pool (``state``: its layout) its arrays' row shapes, dtypes,
    sharding and the bytes of a state chunk."""
    dtypes = ",".join(sorted({str(g.dtype) for g in layout.groups}))
    state_layout = f"{_groups(state)}; {state.slot_bytes} bytes per state chunk" if state is not None else ""
    return Fingerprint(model=deployment.model, kv_layout=_groups(layout), kv_dtype=dtypes,
                       block_size=deployment.block_size, num_hosts=num_hosts, chunk_bytes=layout.slot_bytes,
                       dp_ranks=max(g.num_shards for g in layout.groups), state_layout=state_layout)


class SlotKeys:
    """slot -> (save id, k1, k2) of the last save dispatched into it on this host. A checkpoint
    keeps a slot's keys only where this save id is the slot's committed tag. Main thread only."""

    def __init__(self, num_slots: int) -> None:
        self.save_id = np.full(num_slots, EMPTY_SLOT, np.int64)
        self.keys = np.zeros((num_slots, 2), np.uint64)

    def record(self, slots: np.ndarray, save_ids: np.ndarray, keys: np.ndarray) -> None:
        """The chunks ``save_ids`` with hash keys ``keys`` ((n, 2) uint64) go into ``slots``."""
        self.save_id[slots] = save_ids
        self.keys[slots] = keys


class HostPersistence:
    """One host's warm-restart state: its Persister, the keys of its slots, the checkpoint in flight.
    One per host, whatever the number of DP ranks: a checkpoint holds every slot of the host's
    stores, so every rank's rows, and every slot pool's (a GDN/mamba state pool beside the KV
    pool); each rank's scheduler half talks to it through its own ``RankPersistence``
    (``parts``), the worker's "persist" tier of that rank (worker/tier.py)."""

    def __init__(self, path: str, engines: Sequence[TransferEngine], fingerprint: Fingerprint, host: int,
                 timeout_s: float, faults: PersistFaults | None = None,
                 state_slot: Callable[[], int] = lambda: 0) -> None:
        """``engines``: each slot pool's transfer engine (the KV pool's alone without a state
        pool); ``state_slot``: the engine's first state slot in the step being saved (the saves'
        numbering, worker/pooled_engine.py)."""
        self.engines = tuple(engines)
        self.engine = self.engines[0]
        self.host = host
        table = self.engine.slot_table
        self.ranks, self.shard_slots = table.shards, table.shard_slots  # DP ranks: batch shards of the cache
        self.persister = Persister(path, fingerprint, host=host, barrier_timeout_s=timeout_s, faults=faults)
        self.keys = [SlotKeys(e.slot_table.num_slots) for e in self.engines]  # per slot pool
        self._state_slot = state_slot
        self._inflight: SaveHandle | None = None  # main thread only
        self._inflight_step: int | None = None  # the step that planned it (main thread only)
        self._lock = threading.Lock()  # guards every part's _done (appended by the Persister's waiter thread)
        self._counted: Counter[str] = Counter()  # the Persister's counts already taken
        self._closed = False
        self.parts = [RankPersistence(self, r) for r in range(self.ranks)]
        # tpu-inference's worker does not call the connector's shutdown (0.32): checkpoint at a normal
        # interpreter exit too. Registered with threading's exit hooks, which run (newest first)
        # before the thread pools that orbax and the Persister use are shut down; plain atexit
        # hooks run after that, too late to write anything.
        _register_exit_hook(functools.partial(_close_at_exit, weakref.ref(self)))

    # ---------------------------------------------------------------- start-up
    def restore(self) -> None:
        """Restore the newest complete, matching checkpoint, or start cold (one log line either way).
        Each rank's part reports the restored rows of its own range of slots of every pool, in its
        own numbering (``split_rows``)."""
        restored, reason = self.persister.restore(self.engine.store_targets(),
                                                  [e.store_targets() for e in self.engines[1:]])
        cold = [b""] * self.ranks
        if restored is None:
            logger.info("tpuoffload persist: host %d starting cold: %s", self.host, reason)
            self._set_rows(cold)
            return
        want = (len(_COLUMNS),) if self.ranks == 1 else (self.ranks, len(_COLUMNS))
        pool_tags = [restored.tags] + [p.tags for p in restored.pools]
        shapes = [t.shape[1:] for t in pool_tags]
        if len(pool_tags) != len(self.engines) or any(shape != want for shape in shapes):
            logger.warning("tpuoffload persist: host %d starting cold: %s has slot rows of %s tags, not %s",
                           self.host, restored.path, shapes, [want] * len(self.engines))
            self._set_rows(cold)
            return
        self.engine.replace_stores(restored.stores)
        for engine, pool in zip(self.engines[1:], restored.pools):
            engine.replace_stores(dict(pool.stores))
        per_rank: list[list[bytes]] = [[] for _ in range(self.ranks)]
        counts = []
        for p, tags in enumerate(pool_tags):
            rows = self._restore_pool(p, tags)
            shard_slots = self.engines[p].slot_table.shard_slots
            counts.append(np.bincount(rows["slot"] // shard_slots, minlength=self.ranks))
            for r, part in enumerate(split_rows(rows, self.ranks, shard_slots)):
                per_rank[r].append(part)
        self._set_rows([b"".join(parts) for parts in per_rank])
        logger.info("tpuoffload persist: restored %s on host %d: %d chunks (%s), %.2f GiB in %.1f s",
                    restored.path, self.host, int(sum(c.sum() for c in counts)),
                    ", ".join(f"rank {r}: {int(counts[0][r])}" + "".join(f" + {int(c[r])} of pool {p}"
                                                                         for p, c in enumerate(counts[1:], 1))
                              for r in range(self.ranks)),
                    restored.bytes / 2**30, restored.seconds)

    def _restore_pool(self, pool: int, rows_table: np.ndarray) -> np.ndarray:
        """Install slot pool ``pool``'s restored slot table (by row of its stores) and return its
        restored chunks as ``RESTORED_ROW`` rows (its store's slots, engine numbering)."""
        engine = self.engines[pool]
        table = self._engine_table(rows_table, engine.slot_table)
        shard_slots = engine.slot_table.shard_slots
        held = np.flatnonzero(table[:, 0] != EMPTY_SLOT)
        rank = held // shard_slots
        tags = np.full(len(table), EMPTY_SLOT, np.int64)
        # A restored chunk's save id: its pool's restored id of its slot in its rank's numbering,
        # placed in the rank's range of save ids (what the rank's plans will name it by).
        tags[held] = restored_save_id(pool, held - rank * shard_slots) + (rank << RANK_SAVE_ID_SHIFT)
        sources = table[:, 1].copy()
        if self.ranks > 1:  # a rank's slots hold its batch shard's chunks: name the shard's first block (or row)
            sources[held] = rank * engine.layout.groups[0].blocks_per_shard  # (HBM's size may change)
        engine.slot_table.restore(tags, sources)
        keys = self.keys[pool]
        keys.save_id[held] = tags[held]  # a restored chunk not saved over is checkpointed again
        keys.keys[held] = table[held, 2:].view(np.uint64)
        rows = np.zeros(len(held), RESTORED_ROW)
        rows["slot"], rows["save_id"], rows["pool"] = held, table[held, 0], pool
        rows["k1"], rows["k2"] = table[held, 2].view(np.uint64), table[held, 3].view(np.uint64)
        return rows

    def _row_table(self, table: np.ndarray, slots) -> np.ndarray:
        """A pool's slot table (engine slots x columns) as the checkpoint keeps it, by row of its
        stores (their axis 1; ``slots``: the pool's SlotTable): with one rank the same; under DP
        row ``i`` holds slot ``i`` of every rank's range (each on its batch shard's devices), so
        the table is (rows, ranks, columns), spare rows empty."""
        if self.ranks == 1:
            return table
        rows = np.zeros((slots.rows, self.ranks, len(_COLUMNS)), np.int64)
        rows[..., 0] = EMPTY_SLOT
        rows[:slots.shard_slots] = table.reshape(self.ranks, slots.shard_slots, -1).transpose(1, 0, 2)
        return rows

    def _engine_table(self, rows: np.ndarray, slots) -> np.ndarray:
        """``_row_table``'s inverse: engine slots x columns."""
        if self.ranks == 1:
            return rows
        return rows[:slots.shard_slots].transpose(1, 0, 2).reshape(-1, len(_COLUMNS))

    def _set_rows(self, rows: list[bytes]) -> None:
        for part, part_rows in zip(self.parts, rows):
            part.restored_rows = part_rows

    # ---------------------------------------------------------------- per step
    def before_donate(self) -> None:
        """A save or an install donates the stores: let the checkpoint that reads them finish first."""
        if self._inflight is not None and not self._inflight.done():
            self._inflight.result()

    def saving(self, batch: SaveBatch) -> None:
        """Remember the keys of a save's chunks, each in its slot pool's table (a state slot from
        the step's first state slot on is the state store's slot from 0)."""
        if not batch.keys:
            return
        keys = unpack_keys(batch.keys)
        if len(keys) != len(batch):
            raise ValueError(f"{len(keys)} hash keys for {len(batch)} chunks")
        slots, save_ids = np.asarray(batch.slots, np.int64), np.asarray(batch.save_ids, np.int64)
        if len(self.engines) == 1:
            self.keys[0].record(slots, save_ids, keys)
            return
        boundary = self._state_slot()
        state = slots >= boundary
        self.keys[0].record(slots[~state], save_ids[~state], keys[~state])
        self.keys[1].record(slots[state] - boundary, save_ids[state], keys[state])

    def checkpoint(self, step: int = -1, part: "RankPersistence | None" = None) -> SaveHandle:
        """Write a checkpoint of every slot of this host (main thread, at the start of ``step`` on
        every host; -1: at shutdown). ``part``: the rank whose plan asked, told the outcome; parts
        that ask in the same step share one checkpoint."""
        if step >= 0 and step == self._inflight_step and self._inflight is not None:
            handle = self._inflight
        else:
            self.before_donate()  # one checkpoint at a time
            for engine in self.engines:
                engine.wait_idle()
            tables = [self._row_table(self._keyed_table(engine, keys), engine.slot_table)
                      for engine, keys in zip(self.engines, self.keys)]
            handle = self.persister.save(self.engine.stores(), tables[0], {"columns": list(_COLUMNS)},
                                         pools=[PoolSlots(e.stores(), t) for e, t in zip(self.engines[1:], tables[1:])])
            self._inflight, self._inflight_step = handle, step
        if part is not None:
            handle.add_done_callback(lambda report: self._finished(part, step, report))
        return handle

    @staticmethod
    def _keyed_table(engine: TransferEngine, keys: SlotKeys) -> np.ndarray:
        """A pool's slot table as checkpointed (engine slots x columns): a slot keeps its chunk only
        where the save that holds it brought its keys."""
        tags, sources = engine.slot_table.table()
        keyed = (keys.save_id == tags) & (tags != EMPTY_SLOT)
        table = np.zeros((len(tags), len(_COLUMNS)), np.int64)
        table[:, 0] = np.where(keyed, tags, EMPTY_SLOT)
        table[:, 1] = sources
        table[:, 2:] = keys.keys.view(np.int64)
        table[~keyed, 2:] = 0
        return table

    def _finished(self, part: "RankPersistence", step: int, report) -> None:
        with self._lock:
            part.done.append((step, report.seq, report.ok))

    def take_done(self, part: "RankPersistence") -> list[tuple[int, int, bool]]:
        with self._lock:
            done, part.done = part.done, []
        return done

    def take_counters(self) -> Counter[str]:
        """The Persister's counts (PERSIST_* names) since the last call."""
        now = Counter(self.persister.counters_snapshot())
        delta, self._counted = now - self._counted, now
        return delta

    # ---------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Clean shutdown: a last checkpoint, waited for, then the Persister's threads go."""
        if self._closed:
            return
        self._closed = True
        try:
            report = self.checkpoint().result()
            logger.info("tpuoffload persist: shutdown checkpoint on host %d: %s", self.host,
                        f"{report.path}, {report.chunks} chunks" if report.ok else f"failed: {report.reason}")
        finally:
            self.persister.close()


def split_rows(rows: np.ndarray, ranks: int, shard_slots: int) -> list[bytes]:
    """One slot pool's restored rows (``RESTORED_ROW``, engine numbering of its store) as each DP
    rank's, in the rank's own numbering: the slot within its range, the save id within its range
    of ids (the rank's own save ids; a chunk restored before keeps ``restored_save_id(pool,
    slot)``). With one rank the rows as they are."""
    out = []
    for r in range(ranks):
        mine = rows[rows["slot"] // shard_slots == r].copy()
        mine["slot"] -= r * shard_slots
        mine["save_id"] -= r << RANK_SAVE_ID_SHIFT
        out.append(mine.tobytes())
    return out


class RankPersistence(WorkerTier):
    """The worker's "persist" tier of one DP rank (rank 0 with one scheduler): acts on that rank's
    plan (a checkpoint of the host, shared with the other ranks; a reset revoking the rank's range
    of slots) and reports to that rank's half its restored rows and its checkpoints' outcomes."""

    name = "persist"

    def __init__(self, host: HostPersistence, rank: int) -> None:
        self.host = host
        self.rank = rank
        self.restored_rows: bytes | None = None  # reported until the scheduler stops waiting
        self._rows_sent = False
        self._waiting = False  # the step's plan says the manager still waits for our news
        self.done: list[tuple[int, int, bool]] = []  # (step planned, number, ok), not yet reported (host._lock)
        self._last_done: tuple[int, int, bool] | None = None  # the last checkpoint resolved (repeated on demand)

    @override
    def report(self) -> PersistReport | None:
        """This rank's news: the restored rows (first report), checkpoints resolved since the last
        report; while the manager still waits (``PersistPlan.waiting``) the rows and the last
        resolved checkpoint again, in case a report was lost on the way."""
        repeat = self._waiting
        rows = None
        if self.restored_rows is not None and (repeat or not self._rows_sent):
            rows, self._rows_sent = self.restored_rows, True
        elif self._rows_sent and not repeat:
            self.restored_rows = None  # the manager has them
        done = self.host.take_done(self)
        if done:
            self._last_done = done[-1]
        elif repeat and self._last_done is not None:
            done = [self._last_done]
        if rows is None and not done:
            return None
        return PersistReport(rows, tuple(done))

    @override
    def act(self, step: int, part: PersistPlan | None, placement: Placement = Placement()) -> None:
        part = part or PersistPlan()
        self._waiting = part.waiting
        if part.revoke_below is not None:  # the rank's saves, in the engine's numbering, in every pool
            for engine in self.host.engines:
                engine.slot_table.revoke_below(placement.id_offset + part.revoke_below, self.rank)
        if part.checkpoint:
            try:
                self.host.checkpoint(step, self)
            except Exception:  # a failed checkpoint never stops serving; it is reported as failed
                logger.exception("tpuoffload: checkpoint failed on host %d", self.host.host)

    @override
    def before_donate(self) -> None:
        self.host.before_donate()

    @override
    def saving(self, batch: SaveBatch) -> None:
        if self.rank == 0:  # the host's keys, once per save (the batch holds every rank's saves)
            self.host.saving(batch)

    @override
    def take_counters(self) -> Counter[str]:
        return self.host.take_counters() if self.rank == 0 else Counter()

    @override
    def close(self) -> None:
        self.host.close()  # once, by the first part closed


def _register_exit_hook(fn) -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython since 3.9 has it
        atexit.register(fn)
    else:
        register(fn)


def _close_at_exit(ref: "weakref.ref[HostPersistence]") -> None:
    persistence = ref()
    if persistence is not None and not persistence._closed:
        try:
            persistence.close()
        except Exception:  # noqa: BLE001 - at exit: log, never raise
            logger.exception("tpuoffload persist: checkpoint at exit failed")
