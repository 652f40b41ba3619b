"""The disk tier, the worker's side: spill evicted chunks to this host's disk, fetch them back.

Per step, in ``bind``, before the step's saves (which may reuse the evicted slots) and loads:

    install   fetches planned in earlier steps: wait (bounded) for their background reads, then
              write the chunks into their host-RAM slots (``TransferEngine.install``: one program
              per layer group); their completion is reported like a save, under the fetch's save
              ids, so the scheduler makes them loadable once every host has them
    drop      delete the disk chunks the scheduler evicted from disk
    spill     copy the chunks evicted from host RAM in this plan out of their slots (one read
              program per layer group); a background thread writes them to disk and reports each
              disk id written or failed (``disk_saved``/``disk_failed``), confirmed by every host
              through the manager's disk ledger
    fetch     start the background reads of this plan's fetches (installed next step)

Every dispatch is planned in the metadata and issued here, on the main thread, the same on every
host; a failed read or write only changes what is reported (a fetch whose read failed on this host
installs zeros there, is reported failed, and never becomes loadable anywhere). File I/O and
checksums run on the tier's own threads (backend/disk_tier.py).

Under DPScheduler each DP rank has its own stage (``rank``), acting on its rank's plan only, with
its own files in its own directory (``rank-<r>`` under the host's ``disk_path``): each rank's disk
index numbers its disk ids from 0 and names files by content hash, so two ranks' chunks of one
hash, or under one disk id, never meet in a file. A rank's chunk lives on the devices of its batch
shard (backend/slot_table.py), so its file holds those devices' pieces (``TransferEngine.
rows_to_payloads``) and its install writes them into that shard's rows only
(``TransferEngine.install``); a host with no device of the shard keeps no file for the rank
(``NoChunkFiles``) but dispatches the same programs and confirms like every host.

A GDN/mamba hybrid has two slot pools (worker/pooled_engine.py): the stage keeps one tier of files
per pool, each over its pool's transfer engine, with that pool's chunk size and its share of the
disk budget: the KV pool's files in the rank's directory, the state pool's in its ``state``
sub-directory (``pool_path``). Which pool a chunk file holds is what the plan says
(``DiskBatch.pools``), the one mechanism: a spill reads its pool's store, a fetch is read with
its pool's chunk size and installed into its pool's store, a drop deletes from its pool's
directory. A state chunk's slot is the plan's state slot moved into the state store by the
placement (``Placement.state_offset``: the store's slot 0 on with one scheduler, the rank's share
of the store under DPScheduler, as saves and loads place it). Under DPScheduler the state store
splits over the batch shards as the KV store does (tpu-inference shards the state pool along axis
0 like the attention blocks), so a rank's state files hold its batch shard's pieces and its
installs write that shard's rows, exactly as for its KV chunks. Each pool's rows are dispatched in
pool order, pool 0's first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent import futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from typing_extensions import override
import numpy as np

from tpuoffload import counters as C
from tpuoffload.backend.disk_tier import ChunkKey, DiskFaults, DiskTier, NoChunkFiles, file_bytes_for
from tpuoffload.messages import DISK_ROW, DiskBatch, DiskPlan, DiskReport, id_ranges, unpack_keys
from tpuoffload.worker.tier import Placement, WorkerTier
from tpuoffload.worker.transfer_engine import TransferEngine

logger = logging.getLogger(__name__)


def _hashes(batch: DiskBatch) -> list[bytes]:
    """The 16 bytes of each chunk's hash keys: its name in the tier."""
    return [row.tobytes() for row in unpack_keys(batch.keys)]


#: The sub-directory of a rank's directory that holds each slot pool's chunk files ("": the rank's
#: directory itself), by pool.
POOL_DIRS = ("", "state")


def pool_path(path: str, pool: int) -> str:
    """The directory of slot pool ``pool``'s chunk files in a rank's directory ``path``."""
    return os.path.join(path, POOL_DIRS[pool]) if POOL_DIRS[pool] else path


def rank_path(path: str, rank: int, ranks: int) -> str:
    """The directory of rank ``rank``'s chunk files in this host's ``path``: ``path`` itself with
    one scheduler, ``path/rank-<r>`` under DPScheduler."""
    return path if ranks == 1 else os.path.join(path, f"rank-{rank}")


def clear_other_ranks(path: str, ranks: int) -> int:
    """Delete the chunk files a start with another number of ranks left in this host's ``path``
    (those of one scheduler in ``path`` itself, or of DP ranks this start does not have): chunk
    files are never reused across a change of the DP size (a rank's files hold its batch shard's
    pieces, which another DP size splits differently), and left alone they would take disk space
    outside every rank's budget. Returns the files deleted."""
    if not os.path.isdir(path):
        return 0
    ours = {rank_path(path, r, ranks) for r in range(ranks)}
    others = [path] if ranks > 1 else []
    others += [e.path for e in os.scandir(path) if e.is_dir(follow_symlinks=False) and e.name.startswith("rank-")]
    return sum(DiskTier.clear(d) for d in others if d not in ours)


@dataclass(frozen=True)
class _Part:
    """One slot pool's chunks of a spill or a fetch, in the engine's numbering: their slots in that
    pool's store and their save ids moved by the plan's offsets (disk ids and files are the rank's
    own), and the keys of their files."""

    pool: int
    slots: tuple[int, ...]
    save_ids: tuple[int, ...]
    keys: list[ChunkKey]


def _parts(batch: DiskBatch, placement: Placement) -> list[_Part]:
    """A spill's or a fetch's chunks by slot pool (``DiskBatch.pools``), pool 0's first, their
    slots in their own pool's store (``placement``)."""
    pools = batch.pool_of()
    hashes = _hashes(batch)
    s, i, state = placement
    out = []
    for pool in np.unique(pools).tolist():
        rows = np.flatnonzero(pools == pool).tolist()
        shift = s if pool == 0 else state
        out.append(_Part(pool, tuple(batch.slots[r] + shift for r in rows), tuple(batch.save_ids[r] + i for r in rows),
                         [ChunkKey(int(batch.disk_ids[r]), hashes[r]) for r in rows]))
    return out


@dataclass
class _Fetch:
    step: int
    part: _Part
    reads: list[futures.Future]


class DiskStage(WorkerTier):
    """The worker's "disk" tier (worker/tier.py)."""

    name = "disk"

    def __init__(self, engines: Sequence[TransferEngine], path: str, files: Sequence[int], read_timeout_s: float,
                 faults: DiskFaults | None = None, deployment: str | None = None,
                 before_donate: Callable[[], None] = lambda: None, rank: int = 0) -> None:
        """``engines``: the transfer engine of each slot pool (pool 0's alone without a state
        pool); ``files[p]``: chunk files pool ``p``'s tier may keep (backend/disk_tier.py:
        files_per_rank of the pool's share of the disk, the scheduler's disk index has as many
        entries in that pool), in ``pool_path(path, p)``. ``deployment``: with warm restart, the
        fingerprint that chunk files kept from an earlier start must have been written under
        (None: none is kept, see DiskTier); the kept files are reported until the manager has them.
        ``before_donate``: called before an install donates the stores (the other tiers'
        ``before_donate``). ``rank``: the DP rank (batch shard) whose chunks it keeps, in every
        pool (module doc)."""
        if len(engines) != len(files):
            raise ValueError(f"{len(files)} file budgets for {len(engines)} slot pools")
        self.engines = tuple(engines)
        self.engine = self.engines[0]
        self.rank = rank
        self.tiers: tuple[DiskTier, ...] = tuple(
            self._files(engine.disk_chunk_bytes(rank), pool_path(path, p), n, faults, deployment)
            for p, (engine, n) in enumerate(zip(self.engines, files)))
        for p in range(len(self.tiers), len(POOL_DIRS)):  # a pool this start does not have keeps no file
            if os.path.isdir(pool_path(path, p)):
                DiskTier.clear(pool_path(path, p))
        self.read_timeout_s = read_timeout_s
        self._fetches: list[_Fetch] = []  # main thread only
        self._pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="disk-spill")
        self._lock = threading.Lock()  # guards _written, _failed, _pending
        self._written: list[int] = []  # disk ids written since the last report
        self._failed: list[int] = []
        self._pending = 0  # spills dispatched, not yet resolved
        self._counted: Counter[str] = Counter()
        self._before_donate = before_donate
        self._kept: bytes | None = self.kept_rows() if deployment is not None else None
        self._blind = tuple(p for p, t in enumerate(self.tiers) if isinstance(t, NoChunkFiles))  # reported with _kept
        self._kept_sent = False
        self._waiting = False
        for p, tier in enumerate(self.tiers):
            logger.info("tpuoffload disk tier at %s (pool %d): %d chunk files of %d bytes (%d adopted at start-up)",
                        tier.path, p, tier.capacity_chunks, tier.file_bytes, tier.scan_report.adopted)

    @property
    def tier(self) -> DiskTier:
        """The KV pool's files (the only ones without a state pool)."""
        return self.tiers[0]

    @staticmethod
    def _files(payload: int, path: str, files: int, faults: DiskFaults | None, deployment: str | None) -> DiskTier:
        """One pool's chunk files: ``files`` of ``payload`` bytes each in ``path`` (none: a host that
        holds no byte of the rank's chunks)."""
        if not payload:
            return NoChunkFiles(path)
        return DiskTier(path, files * file_bytes_for(payload), payload, faults=faults, deployment=deployment)

    def kept_rows(self) -> bytes:
        """The chunk files kept from an earlier start, as a warm restart reports them (``DISK_ROW``,
        each pool's least recently used first, pool 0's first); files whose name is not one of our
        16-byte keys are left out."""
        parts = []
        for p, tier in enumerate(self.tiers):
            keys = [k for k in tier.keys() if len(k.hash) == 16]
            rows = np.zeros(len(keys), DISK_ROW)
            if keys:
                rows["disk_id"] = [k.save_id for k in keys]
                hashes = np.frombuffer(b"".join(k.hash for k in keys), "<u8").reshape(-1, 2)
                rows["k1"], rows["k2"], rows["pool"] = hashes[:, 0], hashes[:, 1], p
            parts.append(rows)
        return np.concatenate(parts).tobytes()

    # ---------------------------------------------------------------- per step (main thread)
    @override
    def act(self, step: int, part: DiskPlan | None, placement: Placement = Placement()) -> None:
        part = part or DiskPlan()
        self._waiting = part.waiting
        if part.delete_all:
            self.delete_all()
        try:
            self.run(step, part.drop, _parts(part.spill, placement), _parts(part.fetch, placement))
        except Exception:  # what failed is reported by the stage (failed spills, failed fetches)
            logger.exception("tpuoffload: disk-tier step failed")

    def run(self, step: int, drop: DiskBatch, spill: list[_Part], fetch: list[_Part]) -> None:
        if self._fetches:
            self._before_donate()  # installs donate the stores
            self._install_due(step)
        if len(drop):
            for h, pool in zip(_hashes(drop), drop.pool_of().tolist()):
                self.tiers[pool].delete(h)
        for part in spill:
            self._spill(part)
        for part in fetch:
            self._fetches.append(_Fetch(step, part, [self.tiers[part.pool].read(k) for k in part.keys]))

    def delete_all(self) -> None:
        """A connector reset (``DiskPlan.delete_all``): every chunk file goes, also those kept from
        an earlier start that the manager never indexed (its restore was given up), so no file from
        before a weight update can be taken for a later spill of its hash."""
        for tier in self.tiers:
            for key in tier.keys():
                tier.delete(key.hash)

    def _install_due(self, step: int) -> None:
        due = [f for f in self._fetches if f.step < step]
        self._fetches = [f for f in self._fetches if f.step >= step]
        for f in due:
            deadline = time.monotonic() + self.read_timeout_s
            payloads = []
            for read in f.reads:
                try:
                    result = read.result(timeout=max(0.0, deadline - time.monotonic()))
                except futures.TimeoutError:
                    result = None
                payloads.append(result.data if result is not None and result.ok else None)
            engine, part = self.engines[f.part.pool], f.part
            for piece in engine.pieces(len(part.slots)):
                engine.install(payloads[piece], part.slots[piece], part.save_ids[piece], self.rank)

    def _spill(self, part: _Part) -> None:
        engine = self.engines[part.pool]
        for piece in engine.pieces(len(part.slots)):
            rows, ok = engine.read_slots(part.slots[piece], part.save_ids[piece])
            with self._lock:
                self._pending += 1
            self._pool.submit(self._write, part.pool, rows, ok, part.keys[piece])

    # ---------------------------------------------------------------- background
    def _write(self, pool: int, rows, ok: list[bool], keys: list[ChunkKey]) -> None:
        written, failed = [], [k.save_id for k, good in zip(keys, ok) if not good]
        try:
            payloads = self.engines[pool].rows_to_payloads(rows, self.rank)
            tier = self.tiers[pool]
            writes = [(k, tier.write(k, p)) for k, p, good in zip(keys, payloads, ok) if good]
            for key, w in writes:
                (written if w.future.result().ok else failed).append(key.save_id)
        except Exception as exc:  # noqa: BLE001 - every chunk of the batch is reported failed
            logger.warning("tpuoffload: spill of %d chunks to disk failed: %s", len(keys), exc)
            failed = [k.save_id for k in keys]
            written = []
        with self._lock:
            self._written += written
            self._failed += failed
            self._pending -= 1

    # ---------------------------------------------------------------- reports
    @override
    def report(self) -> DiskReport | None:
        """Disk ids written and failed since the last call; the kept files (warm restart) until the
        manager stops waiting for them."""
        with self._lock:
            written, failed = self._written, self._failed
            self._written, self._failed = [], []
        kept = None
        if self._kept is not None and (self._waiting or not self._kept_sent):
            kept, self._kept_sent = self._kept, True
        elif self._kept_sent and not self._waiting:
            self._kept = None
        if not (written or failed or kept is not None):
            return None
        return DiskReport(id_ranges(written), id_ranges(failed), kept, self._blind if kept is not None else ())

    @override
    def idle_report(self) -> dict[str, int]:
        return {"disk_pending": self.pending()}

    @override
    def take_counters(self) -> Counter[str]:
        """The tier's counts (registered names only) since the last call."""
        now = Counter()
        for tier in self.tiers:
            now.update({k: v for k, v in tier.counters_snapshot().items() if k in C.REGISTRY})
        delta, self._counted = now - self._counted, now
        return delta

    def pending(self) -> int:
        """Spills not yet resolved plus fetches not yet installed (a gauge)."""
        with self._lock:
            return self._pending + len(self._fetches)

    @override
    def wait_idle(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.005)
        return False

    @override
    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
