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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent import futures
from collections.abc import Callable
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


def _placed(batch: DiskBatch, placement: Placement) -> DiskBatch:
    """A spill or fetch in the engine's numbering: its host-RAM slots and save ids moved by the
    plan's offsets (its disk ids are the rank's own, as are its files)."""
    if not len(batch) or placement == Placement():
        return batch
    s, i = placement
    return DiskBatch(tuple(x + s for x in batch.slots), tuple(x + i for x in batch.save_ids), batch.disk_ids, batch.keys)


@dataclass
class _Fetch:
    step: int
    batch: DiskBatch
    reads: list[futures.Future]


class DiskStage(WorkerTier):
    """The worker's "disk" tier (worker/tier.py)."""

    name = "disk"

    def __init__(self, engine: TransferEngine, path: str, files: int, read_timeout_s: float,
                 faults: DiskFaults | None = None, deployment: str | None = None,
                 before_donate: Callable[[], None] = lambda: None, rank: int = 0) -> None:
        """``files``: chunk files the tier may keep (backend/disk_tier.py:files_per_rank, the
        scheduler's disk index has as many entries). ``deployment``: with warm restart, the
        fingerprint that chunk files kept from an earlier start must have been written under
        (None: none is kept, see DiskTier); the kept files are reported until the manager has them.
        ``before_donate``: called before an install donates the stores (the other tiers'
        ``before_donate``). ``rank``: the DP rank (batch shard) whose chunks it keeps (module doc)."""
        self.engine = engine
        self.rank = rank
        payload = engine.disk_chunk_bytes(rank)
        self.tier = (DiskTier(path, files * file_bytes_for(payload), payload, faults=faults, deployment=deployment)
                     if payload else NoChunkFiles(path))
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
        self._kept_sent = False
        self._waiting = False
        logger.info("tpuoffload disk tier at %s: %d chunk files of %d bytes (%d adopted at start-up)",
                    self.tier.path, self.tier.capacity_chunks, self.tier.file_bytes, self.tier.scan_report.adopted)

    def kept_rows(self) -> bytes:
        """The chunk files kept from an earlier start, as a warm restart reports them (``DISK_ROW``,
        least recently used first); files whose name is not one of our 16-byte keys are left out."""
        keys = [k for k in self.tier.keys() if len(k.hash) == 16]
        rows = np.zeros(len(keys), DISK_ROW)
        if keys:
            rows["disk_id"] = [k.save_id for k in keys]
            hashes = np.frombuffer(b"".join(k.hash for k in keys), "<u8").reshape(-1, 2)
            rows["k1"], rows["k2"] = hashes[:, 0], hashes[:, 1]
        return rows.tobytes()

    # ---------------------------------------------------------------- per step (main thread)
    @override
    def act(self, step: int, part: DiskPlan | None, placement: Placement = Placement()) -> None:
        part = part or DiskPlan()
        self._waiting = part.waiting
        if part.delete_all:
            self.delete_all()
        try:
            self.run(step, part.drop, _placed(part.spill, placement), _placed(part.fetch, placement))
        except Exception:  # what failed is reported by the stage (failed spills, failed fetches)
            logger.exception("tpuoffload: disk-tier step failed")

    def run(self, step: int, drop: DiskBatch, spill: DiskBatch, fetch: DiskBatch) -> None:
        if self._fetches:
            self._before_donate()  # installs donate the stores
            self._install_due(step)
        if len(drop):
            for h in _hashes(drop):
                self.tier.delete(h)
        if len(spill):
            self._spill(spill)
        if len(fetch):
            self._fetches.append(_Fetch(step, fetch, [self.tier.read(ChunkKey(int(d), h))
                                                      for d, h in zip(fetch.disk_ids, _hashes(fetch))]))

    def delete_all(self) -> None:
        """A connector reset (``DiskPlan.delete_all``): every chunk file goes, also those kept from
        an earlier start that the manager never indexed (its restore was given up), so no file from
        before a weight update can be taken for a later spill of its hash."""
        for key in self.tier.keys():
            self.tier.delete(key.hash)

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
            for piece in self.engine.pieces(len(f.batch.slots)):
                self.engine.install(payloads[piece], f.batch.slots[piece], f.batch.save_ids[piece], self.rank)

    def _spill(self, batch: DiskBatch) -> None:
        hashes = _hashes(batch)
        for piece in self.engine.pieces(len(batch.slots)):
            rows, ok = self.engine.read_slots(batch.slots[piece], batch.save_ids[piece])
            keys = [ChunkKey(int(d), h) for d, h in zip(batch.disk_ids[piece], hashes[piece])]
            with self._lock:
                self._pending += 1
            self._pool.submit(self._write, rows, ok, keys)

    # ---------------------------------------------------------------- background
    def _write(self, rows, ok: list[bool], keys: list[ChunkKey]) -> None:
        written, failed = [], [k.save_id for k, good in zip(keys, ok) if not good]
        try:
            payloads = self.engine.rows_to_payloads(rows, self.rank)
            writes = [(k, self.tier.write(k, p)) for k, p, good in zip(keys, payloads, ok) if good]
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
        return DiskReport(id_ranges(written), id_ranges(failed), kept)

    @override
    def idle_report(self) -> dict[str, int]:
        return {"disk_pending": self.pending()}

    @override
    def take_counters(self) -> Counter[str]:
        """The tier's counts (registered names only) since the last call."""
        now = Counter({k: v for k, v in self.tier.counters_snapshot().items() if k in C.REGISTRY})
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
        self.tier.close()
