"""Per-host disk tier below host RAM: a bounded, checksummed, LRU store of whole chunks.

A chunk is one host slot (an opaque uint8 row of ``slot_bytes``, see SlotTable) identified by a
``ChunkKey``: the chunk's content hash (what the index is keyed by: one physical chunk per hash)
and the save id it was written under (so a reader that expects save id S never takes a file
written for another save of the same hash).

Format: one plain file per chunk, not orbax
--------------------------------------------
The disk tier needs random access to *single* chunks (a load reads a handful of chunks out of
millions), small independent writes (a chunk evicted from RAM is spilled on its own), deletion of
single chunks (LRU) and a crash-safe state after every single write. orbax-checkpoint writes and
restores whole pytrees as one multi-host transaction (a directory per checkpoint, finalized by
rename, barriers across hosts); a one-chunk write would be a whole checkpoint, and deleting one
chunk is not an operation it has. So each chunk is one file ``<name>.kv``::

    offset 0     header (HEADER_BYTES = 4096, so the payload is page-aligned for the page cache,
                 mmap or O_DIRECT readers):
                   magic b"TPUOKVD1" | u32 format version | u32 header bytes | i64 save id |
                   u64 payload bytes | u32 payload crc32 | u16 hash length | hash bytes |
                   u32 crc32 of everything before it | zero padding
    offset 4096  payload: exactly ``slot_bytes`` bytes

``<name>`` is a 40-hex-digit blake2b digest of the content hash (fixed length whatever the hash
length); the header holds the full hash, and a read checks it. Every file of one tier has the same
size (``file_bytes = HEADER_BYTES + slot_bytes``), so the byte budget is a whole number of files.

Checksum: zlib.crc32 of the payload (and of the header): several times faster than blake2b and
well below a local disk's own read time, where blake2b would cap a reading thread below the disk
(figures and command: docs/performance.md, "Warm restart and the disk tier"). The checksum guards against torn writes, short files and flipped bits (a CRC
detects every burst of up to 32 bits), not against an adversary, so the 7x cheaper CRC is the
right trade.

Contracts
---------
* Budget: ``capacity_bytes`` is exact. At most ``capacity_bytes // file_bytes`` files (committed,
  being written, or evicted but not yet unlinked) ever exist in ``path`` at once: every write owns
  one *unit* from the moment it is accepted; the unit covers its evicted victim's file until that
  file is unlinked, then its own temporary file, then the committed file. Nothing else is written
  there except an empty lock file.
* ``write(key, row)`` returns at once with a ``DiskWrite``: ``evicted`` lists the chunks this write
  pushed out (LRU, committed and not being read), decided synchronously so the caller can report
  them; ``future`` resolves to a ``WriteResult`` in the background (temp file, optional fsync,
  ``os.replace``). A write that finds no room (every chunk is being written or read) is refused at
  once (``ok=False``, ``error="no_space"``); nothing is ever written past the budget.
* ``read(key)`` returns a future of ``ReadResult`` that never raises: either ``ok`` with the exact
  bytes written, or an ``error`` (ABSENT: not held -- never written, evicted, deleted, failed, or
  another save id; MISSING/SHORT/CORRUPT/MISMATCH: the file was lost, truncated, or fails its
  checksum or header; IO: the read failed). A file found broken is deleted and forgotten. A chunk
  being read is pinned: eviction skips it and ``delete`` defers the unlink until the read is done.
* Start-up scan: temp files (``*.tmp``, left by a crash mid-write) are deleted; valid ``*.kv`` files
  of this ``slot_bytes`` are adopted, newest first, up to the budget (their payload checksum is
  checked when they are read); files with a bad header, another size or beyond the budget are
  deleted. Other files are left alone and not counted: give the tier a directory of its own.
* Deployment: ``deployment`` names what the chunks are valid for (the warm-restart fingerprint:
  model, cache layout, hosts). It is kept in the file ``DEPLOYMENT``; a start whose ``deployment``
  differs from it (a missing file reads ``""``) deletes every chunk file instead of adopting it,
  then records its own. ``None`` adopts nothing and records a name no later start can give, so
  the files this start writes are never adopted either.
* Threads: one lock guards the index, the LRU order and the unit count; file I/O runs on the
  tier's own pool, never under the lock. ``faults`` (``DiskFaults``) is called on the pool threads
  and may sleep (slow disk) or raise (failed write/read).
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import os
import struct
import threading
import uuid
import zlib
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from typing_extensions import override

from tpuoffload.backend.files import fsync_dir, unlink_if_present, write_new_file
from tpuoffload.counters import (DISK_ADOPTED, DISK_EVICTED, DISK_READ_BYTES, DISK_READ_CHUNKS, DISK_READ_FAILED,
                                 DISK_WRITE_FAILED, DISK_WRITE_NO_SPACE, DISK_WRITTEN_BYTES, DISK_WRITTEN_CHUNKS)

MAGIC = b"TPUOKVD1"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
DEPLOYMENT_NAME = "DEPLOYMENT"
_FIXED = struct.Struct("<8sIIqQIH")  # magic, version, header bytes, save id, payload bytes, payload crc, hash len
_CRC = struct.Struct("<I")
MAX_HASH_BYTES = HEADER_BYTES - _FIXED.size - _CRC.size

# The tier's own diagnostic counters (in counters_snapshot only; the reported ones are registered
# in tpuoffload/counters.py).
DISK_WRITE_BUSY = "disk_write_busy"
DISK_WRITE_DEDUP = "disk_write_dedup"
DISK_LEAKED_UNITS = "disk_leaked_units"  # a victim's unlink failed: its unit stays counted
DISK_REMOVED_TMP = "disk_removed_tmp"
DISK_REMOVED_INVALID = "disk_removed_invalid"
DISK_REMOVED_OVER_BUDGET = "disk_removed_over_budget"
DISK_REMOVED_FOREIGN = "disk_removed_foreign"


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """What a chunk file is held under: the save id the disk index gave it and its content hash (the
    file's header repeats both, and a read checks them)."""

    save_id: int
    hash: bytes


class ReadError(enum.Enum):
    """Why a read gave no chunk: each member's comment says when."""

    ABSENT = "absent"  # not held under this key: never written, evicted, deleted, failed, other save id
    MISSING = "missing"  # the index held it but the file is gone
    SHORT = "short"  # the file is shorter (or longer) than one chunk
    CORRUPT = "corrupt"  # bad magic/version/header checksum, or payload checksum mismatch
    MISMATCH = "mismatch"  # a valid file, but for another hash or save id
    IO = "io"  # the read itself failed (OSError, or an injected fault)


@dataclass(frozen=True, slots=True)
class WriteResult:
    """A write's outcome: written, or the reason it was not (no space, busy, an error)."""

    key: ChunkKey
    ok: bool
    error: str | None = None  # "no_space", "busy", or what failed


@dataclass(frozen=True, slots=True)
class DiskWrite:
    """What ``write`` returns: the background write, and the chunks it evicted (already gone from
    the index when ``write`` returns; a read of one now answers ABSENT)."""

    future: Future  # Future[WriteResult]
    evicted: tuple[ChunkKey, ...] = ()


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A read's outcome: the payload (``ok``), or why there is none."""

    key: ChunkKey
    data: np.ndarray | None  # uint8 (slot_bytes,) on success (``out`` if given); None on error
    error: ReadError | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class ScanReport:
    """What a start-up scan of the directory did: files adopted and files removed, by reason."""

    adopted: int = 0
    removed_tmp: int = 0
    removed_invalid: int = 0
    removed_over_budget: int = 0
    removed_foreign: int = 0  # chunk files of another deployment


class DiskFaults:
    """Fault-injection interface of the tier (the default does nothing). Each method runs on a
    tier thread and may sleep (a slow disk) or raise (the operation fails for that chunk)."""

    def before_write(self, key: ChunkKey) -> None:
        """Before the temp file is created."""

    def before_commit(self, key: ChunkKey, tmp_path: str) -> None:
        """The temp file holds the whole chunk; it is about to be renamed into place."""

    def before_read(self, key: ChunkKey) -> None:
        """Before the chunk's file is opened."""


class DiskTierError(Exception):
    """The tier cannot start (bad arguments, directory in use by another tier)."""


@dataclass(slots=True)
class _Entry:
    key: ChunkKey
    readers: int = 0  # reads in flight (pinned: not evictable, unlink deferred to the last one)
    doomed: bool = False  # forgotten; its file still has to be unlinked


def file_name(chunk_hash: bytes) -> str:
    return hashlib.blake2b(chunk_hash, digest_size=20).hexdigest() + SUFFIX


def file_bytes_for(slot_bytes: int) -> int:
    """Bytes one chunk occupies on disk (header included)."""
    return HEADER_BYTES + slot_bytes


def files_per_rank(disk_bytes: int, host_chunk_bytes: int, ranks: int = 1) -> int:
    """Chunk files each scheduler half may keep within a host's ``disk_bytes`` (both halves use
    this one rule). With one scheduler: ``disk_bytes // (HEADER_BYTES + host_chunk_bytes)``. Under
    DPScheduler each of the ``ranks`` ranks keeps this many files in its own directory, of
    ``HEADER_BYTES`` plus its chunk's bytes on the host (its batch shard's devices' pieces), and
    those pieces of every rank add up to at most ``host_chunk_bytes``: so every rank's files
    together take at most ``files * (ranks * HEADER_BYTES + host_chunk_bytes) <= disk_bytes``."""
    return disk_bytes // (ranks * HEADER_BYTES + host_chunk_bytes)


def encode_header(key: ChunkKey, payload_len: int, payload_crc: int) -> bytes:
    if len(key.hash) > MAX_HASH_BYTES:
        raise ValueError(f"chunk hash of {len(key.hash)} bytes exceeds {MAX_HASH_BYTES}")
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, key.save_id, payload_len, payload_crc,
                       len(key.hash)) + key.hash
    head += _CRC.pack(zlib.crc32(head))
    return head + bytes(HEADER_BYTES - len(head))


def decode_header(buf: bytes | memoryview) -> tuple[ChunkKey, int, int]:
    """(key, payload bytes, payload crc) of a header; ValueError says what is wrong."""
    if len(buf) < HEADER_BYTES:
        raise ValueError("short header")
    magic, version, hbytes, save_id, plen, pcrc, hlen = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError("bad magic")
    if version != FORMAT_VERSION or hbytes != HEADER_BYTES:
        raise ValueError(f"format version {version}/{hbytes} is not {FORMAT_VERSION}/{HEADER_BYTES}")
    if hlen > MAX_HASH_BYTES:
        raise ValueError("bad hash length")
    end = _FIXED.size + hlen
    (crc,) = _CRC.unpack_from(buf, end)
    if crc != zlib.crc32(buf[:end]):
        raise ValueError("header checksum mismatch")
    return ChunkKey(save_id, bytes(buf[_FIXED.size:end])), plen, pcrc


class DiskTier:
    """This host's chunk files in one local directory: a checksummed file per chunk, written and read
    on the tier's threads, never more files than ``capacity_bytes`` holds (the oldest evicted),
    kept across restarts of the same deployment. Every outcome is a result (``WriteResult``,
    ``ReadResult``), never an exception out of a thread."""

    def __init__(self, path: str, capacity_bytes: int, slot_bytes: int, *, threads: int = 2,
                 fsync: bool = False, faults: DiskFaults | None = None, deployment: str | None = "") -> None:
        if not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise DiskTierError(f"slot_bytes must be a positive int, got {slot_bytes!r}")
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise DiskTierError(f"disk_bytes_to_use must be a positive int, got {capacity_bytes!r}")
        self.path = os.path.abspath(path)
        self.slot_bytes = slot_bytes
        self.file_bytes = file_bytes_for(slot_bytes)
        self.capacity_bytes = capacity_bytes
        self.capacity_chunks = capacity_bytes // self.file_bytes
        if self.capacity_chunks == 0:
            raise DiskTierError(f"disk_bytes_to_use={capacity_bytes} is smaller than one chunk file "
                                f"({self.file_bytes} bytes)")
        self.fsync = fsync
        self.deployment = deployment
        self._faults = faults or DiskFaults()
        os.makedirs(self.path, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise DiskTierError(f"{self.path} is in use by another disk tier") from None
        # _lock guards: _entries, _lru, _writing, _doomed, _units, counters, _closed.
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}  # hash -> committed chunk, readable
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # the keys of _entries, least recent first
        self._writing: dict[bytes, ChunkKey] = {}  # hash -> key of the write in flight
        # hash -> forgotten chunk whose file is not unlinked yet (by its last reader, by the write
        # that evicted it, or by a delete task). A write of such a hash is refused ("busy"), so an
        # unlink never hits a newer file of the same name.
        self._doomed: dict[bytes, _Entry] = {}
        self._units = 0  # files that may exist: committed + doomed + writes in flight (<= capacity_chunks)
        self._closed = False
        self.counters: Counter[str] = Counter()
        self.scan_report = self._scan()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="disk-tier")

    # ---------------------------------------------------------------- queries
    @property
    def used_bytes(self) -> int:
        """Bytes of files that may exist now (never above capacity_bytes)."""
        with self._lock:
            return self._units * self.file_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def contains(self, key: ChunkKey) -> bool:
        """True if the chunk is committed under exactly this key."""
        with self._lock:
            entry = self._entries.get(key.hash)
            return entry is not None and entry.key == key

    def counters_snapshot(self) -> dict[str, int]:
        """A copy of the tier's counters (the DISK_* names), for the stats report."""
        with self._lock:
            return dict(self.counters)

    def keys(self) -> list[ChunkKey]:
        """Committed chunks, least recently used first (e.g. to report what was adopted)."""
        with self._lock:
            return [self._entries[h].key for h in self._lru]

    # ---------------------------------------------------------------- writes
    def write(self, key: ChunkKey, row: np.ndarray) -> DiskWrite:
        """Store ``row`` (``slot_bytes`` contiguous bytes) under ``key`` in the background. The
        caller must not modify ``row`` until the future resolves. A committed chunk of the same
        hash and another save id is replaced (it is listed in ``evicted``); the same key again is a
        no-op (``ok``)."""
        payload = _as_bytes_view(row, self.slot_bytes)
        victims: list[_Entry] = []
        with self._lock:
            if self._closed:
                return self._done_write(key, "closed")
            current = self._entries.get(key.hash)
            if current is not None and current.key == key:
                self.counters[DISK_WRITE_DEDUP] += 1
                self._lru.move_to_end(key.hash)
                return self._done_write(key, None)
            if key.hash in self._writing or key.hash in self._doomed or (current is not None and current.readers):
                self.counters[DISK_WRITE_BUSY] += 1
                return self._done_write(key, "busy")
            victim = current  # another save of this hash: it goes first (its file and the new
            if victim is None and self._units >= self.capacity_chunks:  # one never coexist)
                victim = self._lru_victim()
                if victim is None:
                    self.counters[DISK_WRITE_NO_SPACE] += 1
                    return self._done_write(key, "no_space")
            if victim is None:
                self._units += 1
            else:  # its unit passes to this write, which unlinks its file before creating its own
                self._forget(victim)
                victim.doomed = True
                self._doomed[victim.key.hash] = victim
                self.counters[DISK_EVICTED] += 1
                victims.append(victim)
            # This write now owns one unit: its victim's file until unlinked, then its own.
            self._writing[key.hash] = key
        future = self._pool.submit(self._write_task, key, payload, victims)
        return DiskWrite(future, tuple(v.key for v in victims))

    def _lru_victim(self) -> _Entry | None:
        for h in self._lru:  # least recent first; entries being read are skipped
            entry = self._entries[h]
            if not entry.readers:
                return entry
        return None

    def _forget(self, entry: _Entry) -> _Entry:
        """Drop a committed entry from the index (caller holds the lock): reads answer ABSENT from
        now on. Its unit stays counted until its file is unlinked (or passes to the write that
        evicted it)."""
        del self._entries[entry.key.hash]
        del self._lru[entry.key.hash]
        return entry

    def _done_write(self, key: ChunkKey, error: str | None) -> DiskWrite:
        future: Future = Future()
        future.set_result(WriteResult(key, error is None, error))
        return DiskWrite(future)

    def _write_task(self, key: ChunkKey, payload: memoryview, victims: list[_Entry]) -> WriteResult:
        final = os.path.join(self.path, file_name(key.hash))
        tmp = os.path.join(self.path, f".{file_name(key.hash)}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")
        try:
            for victim in victims:
                unlink_if_present(os.path.join(self.path, file_name(victim.key.hash)))
        except OSError as e:  # the victim's file may still be there: keep its unit counted for good
            with self._lock:
                del self._writing[key.hash]
                for victim in victims:
                    del self._doomed[victim.key.hash]
                self.counters[DISK_WRITE_FAILED] += 1
                self.counters[DISK_LEAKED_UNITS] += 1
            return WriteResult(key, False, f"evicting: {type(e).__name__}: {e}")
        with self._lock:
            for victim in victims:
                del self._doomed[victim.key.hash]
        try:
            self._faults.before_write(key)
            header = encode_header(key, len(payload), zlib.crc32(payload))
            write_new_file(tmp, [header, payload], self.fsync)
            self._faults.before_commit(key, tmp)
            os.replace(tmp, final)
            if self.fsync:
                fsync_dir(self.path)
        except BaseException as e:  # noqa: BLE001 - any failure is this chunk's write error
            unlink_if_present(tmp)
            with self._lock:
                del self._writing[key.hash]
                self._units -= 1
                self.counters[DISK_WRITE_FAILED] += 1
            return WriteResult(key, False, f"{type(e).__name__}: {e}")
        with self._lock:
            del self._writing[key.hash]
            self._entries[key.hash] = _Entry(key)
            self._lru[key.hash] = None
            self.counters[DISK_WRITTEN_CHUNKS] += 1
            self.counters[DISK_WRITTEN_BYTES] += self.file_bytes
        return WriteResult(key, True)

    # ---------------------------------------------------------------- reads
    def read(self, key: ChunkKey, out: np.ndarray | None = None) -> Future:
        """Read the chunk in the background; the future's ``ReadResult`` never raises. With
        ``out`` (a writable uint8 buffer of ``slot_bytes``) the bytes land there (zeroed on
        error); otherwise a new array is returned."""
        if out is not None:
            _as_bytes_view(out, self.slot_bytes, writable=True)
        with self._lock:
            entry = self._entries.get(key.hash)
            if self._closed or entry is None or entry.key != key:
                self.counters[DISK_READ_FAILED] += 1
                self.counters[f"{DISK_READ_FAILED}_{ReadError.ABSENT.value}"] += 1
                future: Future = Future()
                if out is not None:
                    out[...] = 0
                future.set_result(ReadResult(key, None, ReadError.ABSENT, "not held under this key"))
                return future
            entry.readers += 1
            self._lru.move_to_end(key.hash)
        return self._pool.submit(self._read_task, entry, out)

    def _read_task(self, entry: _Entry, out: np.ndarray | None) -> ReadResult:
        key = entry.key
        path = os.path.join(self.path, file_name(key.hash))
        data = np.empty(self.slot_bytes, np.uint8) if out is None else out.reshape(-1).view(np.uint8)
        error, detail = None, ""
        try:
            self._faults.before_read(key)
            error, detail = self._read_file(path, key, data)
        except BaseException as e:  # noqa: BLE001 - any failure is this chunk's read error
            error, detail = ReadError.IO, f"{type(e).__name__}: {e}"
        unlink = False
        with self._lock:
            entry.readers -= 1
            if error is None:
                self.counters[DISK_READ_CHUNKS] += 1
                self.counters[DISK_READ_BYTES] += self.file_bytes
            else:
                self.counters[DISK_READ_FAILED] += 1
                self.counters[f"{DISK_READ_FAILED}_{error.value}"] += 1
                if error is not ReadError.IO and not entry.doomed:
                    self._forget(entry)  # a broken file is never offered again ...
                    entry.doomed = True  # ... and is deleted (by the last read holding it)
                    self._doomed[key.hash] = entry
            unlink = entry.doomed and entry.readers == 0
        if unlink:
            self._unlink_doomed(entry)
        if error is not None:
            if out is not None:
                data[...] = 0
            return ReadResult(key, None, error, detail)
        return ReadResult(key, data if out is None else out)

    def _read_file(self, path: str, key: ChunkKey, data: np.ndarray) -> tuple[ReadError | None, str]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return ReadError.MISSING, f"{path} is gone"
        try:
            size = os.fstat(fd).st_size
            if size != self.file_bytes:
                return ReadError.SHORT, f"{path} has {size} bytes, a chunk file has {self.file_bytes}"
            header = bytearray(HEADER_BYTES)
            if _read_all(fd, memoryview(header), 0) != HEADER_BYTES:
                return ReadError.SHORT, f"{path}: short header"
            try:
                got, plen, pcrc = decode_header(header)
            except ValueError as e:
                return ReadError.CORRUPT, f"{path}: {e}"
            if got != key:
                return ReadError.MISMATCH, f"{path} holds save {got.save_id} of another chunk or save"
            if plen != self.slot_bytes:
                return ReadError.SHORT, f"{path}: payload of {plen} bytes, expected {self.slot_bytes}"
            view = memoryview(data).cast("B")
            if _read_all(fd, view, HEADER_BYTES) != self.slot_bytes:
                return ReadError.SHORT, f"{path}: short payload"
            if zlib.crc32(view) != pcrc:
                return ReadError.CORRUPT, f"{path}: payload checksum mismatch"
            return None, ""
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- deletes, lifecycle
    def delete(self, chunk_hash: bytes) -> bool:
        """Forget a committed chunk (the scheduler evicted it): reads answer ABSENT at once; its
        file is unlinked in the background, or by its last read. False if none has this hash."""
        with self._lock:
            entry = self._entries.get(chunk_hash)
            if entry is None or self._closed:
                return False
            self._forget(entry)
            entry.doomed = True
            self._doomed[chunk_hash] = entry
            if entry.readers:
                return True
        self._pool.submit(self._unlink_doomed, entry)
        return True

    def _unlink_doomed(self, entry: _Entry) -> None:
        unlink_if_present(os.path.join(self.path, file_name(entry.key.hash)))
        with self._lock:
            del self._doomed[entry.key.hash]
            self._units -= 1

    def close(self) -> None:
        """Finish every queued write and read, then release the directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)

    @classmethod
    def clear(cls, path: str) -> int:
        """Delete every chunk file in ``path``, a tier directory that no tier of this start uses
        (the start-up scan of a tier that keeps nothing: ``deployment`` None); refused, like any
        tier, while a live one holds the directory. Returns the files deleted."""
        tier = cls(path, file_bytes_for(1), 1, deployment=None)
        tier.close()
        return tier.scan_report.removed_foreign

    def __enter__(self) -> "DiskTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- start-up scan
    def _scan(self) -> ScanReport:
        """Adopt valid chunk files (newest first, within the budget); delete temp files, invalid
        files and files over the budget. Runs in the constructor, before any thread exists."""
        removed_tmp = removed_invalid = removed_over = removed_foreign = 0
        foreign = self.deployment is None or _read_text(os.path.join(self.path, DEPLOYMENT_NAME)) != self.deployment
        found: list[tuple[float, str, ChunkKey]] = []
        with os.scandir(self.path) as it:
            names = [(e.name, e) for e in it if e.is_file(follow_symlinks=False)]
        for name, dirent in names:
            full = os.path.join(self.path, name)
            if name.endswith(TMP_SUFFIX):
                unlink_if_present(full)
                removed_tmp += 1
                continue
            if not name.endswith(SUFFIX):
                continue  # not ours: left alone, not counted
            if foreign:
                unlink_if_present(full)
                removed_foreign += 1
                continue
            key = self._valid_file(full, name, dirent)
            if key is None:
                unlink_if_present(full)
                removed_invalid += 1
            else:
                found.append((dirent.stat().st_mtime, name, key))
        found.sort(key=lambda t: (t[0], t[1]))  # oldest first
        keep = found[max(0, len(found) - self.capacity_chunks):]
        for _, name, _ in found[: len(found) - len(keep)]:
            unlink_if_present(os.path.join(self.path, name))
            removed_over += 1
        for _, _, key in keep:
            self._entries[key.hash] = _Entry(key)
            self._lru[key.hash] = None
        self._units = len(keep)
        if foreign:  # after the deletions: a crash before this line leaves the old record
            self._record_deployment()
        report = ScanReport(len(keep), removed_tmp, removed_invalid, removed_over, removed_foreign)
        self.counters[DISK_ADOPTED] += report.adopted
        self.counters[DISK_REMOVED_TMP] += removed_tmp
        self.counters[DISK_REMOVED_INVALID] += removed_invalid
        self.counters[DISK_REMOVED_OVER_BUDGET] += removed_over
        self.counters[DISK_REMOVED_FOREIGN] += removed_foreign
        return report

    def _record_deployment(self) -> None:
        # None: a record no later start can name, so nothing this start writes is ever adopted.
        deployment = f"unknown {uuid.uuid4().hex}" if self.deployment is None else self.deployment
        record = os.path.join(self.path, DEPLOYMENT_NAME)
        tmp = record + TMP_SUFFIX
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(deployment)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, record)
        fsync_dir(self.path)

    def _valid_file(self, full: str, name: str, dirent: os.DirEntry) -> ChunkKey | None:
        try:
            if dirent.stat(follow_symlinks=False).st_size != self.file_bytes:
                return None
            with open(full, "rb", buffering=0) as f:
                header = f.read(HEADER_BYTES)
            key, plen, _ = decode_header(header)
        except (OSError, ValueError):
            return None
        if plen != self.slot_bytes or file_name(key.hash) != name:
            return None
        return key


# ---------------------------------------------------------------- small I/O helpers
def _as_bytes_view(arr: np.ndarray, nbytes: int, writable: bool = False) -> memoryview:
    if not isinstance(arr, np.ndarray) or arr.nbytes != nbytes or not arr.flags.c_contiguous:
        raise ValueError(f"a chunk is a C-contiguous array of {nbytes} bytes, got "
                         f"{getattr(arr, 'shape', None)} {getattr(arr, 'dtype', type(arr).__name__)}")
    if writable and not arr.flags.writeable:
        raise ValueError("out must be writable")
    return memoryview(arr.reshape(-1).view(np.uint8)).cast("B")


def _read_all(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _read_text(path: str) -> str:
    """A small text file's contents; "" if it does not exist."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return ""


__all__ = ["ChunkKey", "DiskFaults", "DiskTier", "DiskTierError", "DiskWrite", "ReadError", "ReadResult",
           "ScanReport", "WriteResult", "file_bytes_for"]


class NoChunkFiles(DiskTier):
    """The files of chunks of which this host holds no byte (under DPScheduler, a rank whose batch
    shard has no device on this host): every write succeeds with nothing written, every read of a
    key is an empty payload, nothing is kept. So such a host confirms a rank's spills and fetches
    like any other (the scheduler's disk ledger counts every host) and dispatches the same install
    programs (of zero-width rows for its devices, which are another shard's)."""

    def __init__(self, path: str) -> None:  # noqa: D107 - no directory, no thread, no lock file
        self.path = os.path.abspath(path)
        self.slot_bytes = 0
        self.file_bytes = 0
        self.capacity_bytes = 0
        self.capacity_chunks = 0
        self.deployment = None
        self.scan_report = ScanReport()

    @override
    @property
    def used_bytes(self) -> int:
        return 0

    @override
    def __len__(self) -> int:
        return 0

    @override
    def contains(self, key: ChunkKey) -> bool:
        return False

    @override
    def counters_snapshot(self) -> dict[str, int]:
        return {}

    @override
    def keys(self) -> list[ChunkKey]:
        return []

    @override
    def write(self, key: ChunkKey, row: np.ndarray) -> DiskWrite:
        return self._done_write(key, None)

    @override
    def read(self, key: ChunkKey, out: np.ndarray | None = None) -> Future:
        future: Future = Future()
        future.set_result(ReadResult(key, np.zeros(0, np.uint8)))
        return future

    @override
    def delete(self, chunk_hash: bytes) -> bool:
        return False

    @override
    def close(self) -> None:
        pass
