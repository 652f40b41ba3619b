"""The shared KV tier's storage: one small contract (``SharedStore``), one object format, backends.

Every replica of a deployment reads and writes the same store (a directory on a shared filesystem,
a Valkey/Redis server). The scheduler half never touches it: each host writes and reads only its
own shard of a chunk, as its own object, on the worker's background threads (worker/shared_stage.py).

Objects
-------
An object is immutable and content addressed: its name is derived from an ``ObjectId``, which is
everything that determines its bytes::

    namespace   16 bytes: a digest of model, KV dtype, block size, the cache layout on this host and
                its sharding over hosts, chunk bytes, vLLM's block-hash seed (hash function and
                PYTHONHASHSEED) and the operator's salt (worker/shared_stage.py:namespace)
    key         16 bytes: the chunk's content key (vLLM's block hash, the same for every group)
    group       its KV cache group (as vLLM's offload key is a block hash and a group: with
                several groups every group's chunk of a block is its own object)
    shard       this host's index, and the number of hosts (``num_shards``)
    pool        its host slot pool: 0, KV chunks (one block of every attention array), or 1, a
                GDN/mamba hybrid's state chunks (one row of every state array, another size),
                so a state chunk is never read as a KV chunk or the reverse

and it is published once (put-if-absent: nobody ever replaces an object, so a name always means
the same bytes) and never modified. Its bytes are a header then the payload (one host's part of
the chunk, exactly ``payload bytes``)::

    magic b"TPUOKVS1" | u16 version | u16 header bytes | namespace | key | u32 group | u16 shard |
    u16 num_shards | u64 payload bytes | u32 payload crc32 | u8 pool | reserved zeros |
    u32 crc32 of the above

(the pool byte was reserved before there were state pools: a KV-pool object's name and bytes are
what they were).

``decode_object`` checks all of it against the ``ObjectId`` the reader asked for and the payload
length it expects: a torn or truncated object is ``SHORT``, a flipped bit ``CORRUPT``, an object
of another namespace, key, group, shard or pool under this name ``FOREIGN``. Any of them is a miss.
CRC32: the same trade as the disk tier (backend/disk_tier.py): it catches torn writes, truncation
and bit flips at a few GiB/s per thread with the GIL released; it is not a defence against a
writer that forges objects (whoever can write the store can serve wrong KV).

The contract
------------
``put_if_absent`` publishes atomically (no reader ever sees a partial object under its name) and
never overwrites; ``get`` returns the whole object or None; ``exists_many`` answers for many names
in one round trip where the backend can; ``delete`` removes a name. A backend that cannot answer
(unreachable, timed out) raises ``StoreUnavailable``, never blocks longer than its timeout.

The configuration is one URL (``SharedURL.parse``): ``file:///mnt/lustre/kv`` (FileStore, here) or
``redis://host:6379/0`` (backend/shared_store_redis.py), with optional query parameters.
"""

from __future__ import annotations

import abc
import enum
import errno
import fcntl
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from typing_extensions import override

from tpuoffload.backend.files import fsync_dir, unlink_if_present, write_new_file

logger = logging.getLogger(__name__)

MAGIC = b"TPUOKVS1"
FORMAT_VERSION = 1
HEADER_BYTES = 128
_HEAD = struct.Struct("<8sHH16s16sIHHQI")  # up to the payload crc; the pool byte, reserved zeros, the header crc
_POOL_AT = _HEAD.size
_HEADER_CRC_AT = HEADER_BYTES - 4
TMP_PREFIX = ".tmp."
SUFFIX = ".kv"
EVICT_LOCK = ".evict.lock"


class StoreUnavailable(Exception):
    """The store did not answer (unreachable, timed out, refused): a miss, counted, never a hang."""


class ObjectError(enum.Enum):
    """Why an object is a miss."""

    ABSENT = "absent"  # no object under this name
    SHORT = "short"  # torn or truncated: fewer bytes than its header (or the reader) says
    CORRUPT = "corrupt"  # a bad magic, version, header checksum or payload checksum
    FOREIGN = "foreign"  # another namespace, key, group, shard or pool under this name
    UNAVAILABLE = "unavailable"  # the store did not answer in time


@dataclass(frozen=True)
class ObjectId:
    """The name of one object in the shared store: a 16-byte namespace (the deployment) and key (the
    chunk), its KV cache group, which of ``num_shards`` host shards of the chunk it holds, and its
    host slot pool (module doc); ``name`` is the same string in every backend."""

    namespace: bytes
    key: bytes
    group: int
    shard: int
    num_shards: int
    pool: int = 0

    def __post_init__(self) -> None:
        if len(self.namespace) != 16 or len(self.key) != 16:
            raise ValueError("an object's namespace and key are 16 bytes each")

    @property
    def name(self) -> str:
        """``<namespace>/h<shard>of<hosts>/<key>.g<group>``, then ``.p<pool>`` for a pool other than
        the KV pool: the same string in every backend."""
        pool = f".p{self.pool}" if self.pool else ""
        return f"{self.namespace.hex()}/h{self.shard}of{self.num_shards}/{self.key.hex()}.g{self.group}{pool}"


def encode_header(oid: ObjectId, payload: Any) -> bytes:
    """The header of ``oid``'s object with ``payload`` (any buffer; its crc32 is computed here)."""
    view = memoryview(payload).cast("B")
    head = bytearray(HEADER_BYTES)
    _HEAD.pack_into(head, 0, MAGIC, FORMAT_VERSION, HEADER_BYTES, oid.namespace, oid.key, oid.group, oid.shard,
                    oid.num_shards, len(view), zlib.crc32(view))
    head[_POOL_AT] = oid.pool
    struct.pack_into("<I", head, _HEADER_CRC_AT, zlib.crc32(memoryview(head)[:_HEADER_CRC_AT]))
    return bytes(head)


def decode_object(oid: ObjectId, data: Any, payload_bytes: int) -> tuple[memoryview | None, ObjectError | None, str]:
    """``(payload, None, "")`` if ``data`` is exactly ``oid``'s object with a payload of
    ``payload_bytes`` bytes, else ``(None, error, detail)``. Never raises."""
    if data is None:
        return None, ObjectError.ABSENT, "no object"
    view = memoryview(data).cast("B")
    if len(view) < HEADER_BYTES:
        return None, ObjectError.SHORT, f"{len(view)} bytes, less than a header"
    if bytes(view[:8]) != MAGIC:
        return None, ObjectError.CORRUPT, "bad magic"
    (header_crc,) = struct.unpack_from("<I", view, _HEADER_CRC_AT)
    if zlib.crc32(view[:_HEADER_CRC_AT]) != header_crc:
        return None, ObjectError.CORRUPT, "header checksum mismatch"
    _, version, hbytes, ns, key, group, shard, num_shards, plen, pcrc = _HEAD.unpack_from(view, 0)
    if version != FORMAT_VERSION or hbytes != HEADER_BYTES:
        return None, ObjectError.FOREIGN, f"format version {version} ({hbytes}-byte header)"
    pool = view[_POOL_AT]
    if (ns, key, group, shard, num_shards, pool) != (oid.namespace, oid.key, oid.group, oid.shard, oid.num_shards,
                                                     oid.pool):
        return None, ObjectError.FOREIGN, "another namespace, key, group, shard or pool"
    if plen != payload_bytes:
        return None, ObjectError.FOREIGN, f"payload of {plen} bytes, expected {payload_bytes}"
    if len(view) != HEADER_BYTES + plen:
        return None, ObjectError.SHORT, f"{len(view) - HEADER_BYTES} payload bytes, header says {plen}"
    payload = view[HEADER_BYTES:]
    if zlib.crc32(payload) != pcrc:
        return None, ObjectError.CORRUPT, "payload checksum mismatch"
    return payload, None, ""


class SharedStore(abc.ABC):
    """One shared store. Thread safe: the worker's background threads call it concurrently. Every
    call either answers or raises ``StoreUnavailable`` within the store's timeout."""

    #: Backend name for logs and counters ("file", "redis").
    kind: str = ""

    @abc.abstractmethod
    def put_if_absent(self, name: str, header: bytes, payload: Any) -> bool:
        """Publish ``header + payload`` under ``name`` unless an object has that name: True if this
        call published it, False if one was there (it is left as it is). Atomic: a reader sees the
        whole object under ``name`` or none. Raises StoreUnavailable."""

    @abc.abstractmethod
    def get(self, name: str) -> bytes | bytearray | None:
        """The whole object under ``name``, or None if there is none. Raises StoreUnavailable."""

    @abc.abstractmethod
    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each name has an object (one round trip where the backend can). Raises
        StoreUnavailable."""

    @abc.abstractmethod
    def delete(self, name: str) -> bool:
        """Remove ``name``'s object; False if there was none. Raises StoreUnavailable."""

    def close(self) -> None:
        """Release connections and files."""


# ---------------------------------------------------------------------------- the URL
@dataclass(frozen=True)
class SharedURL:
    """``shared_url`` parsed. Query parameters (all optional):

    ``timeout_s``        every store operation's bound (default 2): a slower answer is a miss
    ``queue_bytes``      per host, bytes of writes waiting for the store (default 256 MiB); beyond
                         it a write is dropped and counted, never waited for
    ``write_bytes_per_s`` per host, the writers' bandwidth (default: unbounded)
    ``namespace``        the operator's salt, part of every object's namespace: change it when the
                         weights change under the same model name
    file only: ``bytes`` (the store's byte budget, default none: the filesystem's own quota),
    ``high``/``low`` (watermarks, fractions of ``bytes``: eviction starts above ``high`` and stops
    at ``low``; defaults 0.9/0.8), ``fsync`` (default 1), ``scan_s`` (how often a writer
    re-reads the store's usage, default 10).
    """

    scheme: str
    location: str  # file: the directory; redis: the URL without the query
    timeout_s: float = 2.0
    queue_bytes: int = 256 << 20
    write_bytes_per_s: float | None = None
    namespace: str = ""
    budget_bytes: int | None = None
    high: float = 0.9
    low: float = 0.8
    fsync: bool = True
    scan_s: float = 10.0
    extra: dict[str, str] = field(default_factory=dict)

    SCHEMES = ("file", "redis", "rediss", "valkey")

    @classmethod
    def parse(cls, url: Any) -> "SharedURL":
        """Raises ValueError naming what is wrong (no network access)."""
        where = "kv_connector_extra_config['shared_url']"
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where} must be a URL such as 'file:///mnt/lustre/kv' or 'redis://host:6379', "
                             f"got {url!r}")
        parts = urlsplit(url)
        if parts.scheme not in cls.SCHEMES:
            raise ValueError(f"{where}={url!r}: unknown scheme {parts.scheme!r}; use one of "
                             f"{', '.join(s + '://' for s in cls.SCHEMES)}")
        try:
            query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)).items()}
        except ValueError as e:
            raise ValueError(f"{where}={url!r}: unreadable query: {e}") from None
        file_keys = {"bytes", "high", "low", "fsync", "scan_s"}
        known = {"timeout_s", "queue_bytes", "write_bytes_per_s", "namespace"} | (file_keys if parts.scheme == "file" else set())
        unknown = sorted(set(query) - known)
        if unknown:
            raise ValueError(f"{where}={url!r}: unknown parameter(s) {unknown}; known for {parts.scheme}: {sorted(known)}")

        def num(name: str, kind, low: float, high: float):
            try:
                value = kind(query[name])
            except ValueError:
                raise ValueError(f"{where}={url!r}: {name}={query[name]!r} is not a {kind.__name__}") from None
            if not low <= value <= high:
                raise ValueError(f"{where}={url!r}: {name}={value} is outside {low}..{high}")
            return value

        out: dict[str, Any] = {}
        if "timeout_s" in query:
            out["timeout_s"] = num("timeout_s", float, 0.001, 600.0)
        if "queue_bytes" in query:
            out["queue_bytes"] = num("queue_bytes", int, 1, 1 << 44)
        if "write_bytes_per_s" in query:
            out["write_bytes_per_s"] = num("write_bytes_per_s", float, 1.0, float(1 << 50))
        if "namespace" in query:
            out["namespace"] = query["namespace"]
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ValueError(f"{where}={url!r}: a file URL names a path on this host (file:///path), "
                                 f"not host {parts.netloc!r}; mount the shared filesystem and give its path")
            if not parts.path.startswith("/") or parts.path == "/":
                raise ValueError(f"{where}={url!r}: give an absolute directory, e.g. file:///mnt/lustre/kv")
            location = parts.path
            if "bytes" in query:
                out["budget_bytes"] = num("bytes", int, 1, 1 << 60)
            for name in ("high", "low"):
                if name in query:
                    out[name] = num(name, float, 0.0, 1.0)
            if out.get("low", 0.8) >= out.get("high", 0.9):
                raise ValueError(f"{where}={url!r}: low ({out.get('low', 0.8)}) must be below high "
                                 f"({out.get('high', 0.9)})")
            if "fsync" in query:
                if query["fsync"] not in ("0", "1"):
                    raise ValueError(f"{where}={url!r}: fsync must be 0 or 1")
                out["fsync"] = query["fsync"] == "1"
            if "scan_s" in query:
                out["scan_s"] = num("scan_s", float, 0.0, 86400.0)
        else:
            if not parts.hostname:
                raise ValueError(f"{where}={url!r}: a {parts.scheme} URL needs a host, e.g. redis://kv-cache:6379")
            try:
                parts.port  # noqa: B018 - raises on a bad port
            except ValueError as e:
                raise ValueError(f"{where}={url!r}: {e}") from None
            db = parts.path.strip("/")
            if db and not db.isdigit():
                raise ValueError(f"{where}={url!r}: the path names a database number (redis://host:6379/0), got {db!r}")
            location = parts._replace(query="", fragment="").geturl()
        return cls(parts.scheme, location, **out)


def open_store(spec: SharedURL) -> SharedStore:
    """The backend ``spec`` names (connects lazily: an unreachable store is a miss, not an error)."""
    if spec.scheme == "file":
        return FileStore(spec.location, budget_bytes=spec.budget_bytes, high=spec.high, low=spec.low,
                         fsync=spec.fsync, scan_s=spec.scan_s)
    from tpuoffload.backend.shared_store_redis import RedisStore

    return RedisStore(spec.location.replace("valkey://", "redis://", 1), timeout_s=spec.timeout_s)


# ---------------------------------------------------------------------------- the POSIX directory
@dataclass
class FileFaults:
    """Test hooks (tpuoffload never sets them): ``after_open(path)`` runs in ``get`` between opening
    the object and reading it; ``evict_unlink(path)`` replaces the evictor's removal of a file."""

    after_open: Callable[[str], None] | None = None
    evict_unlink: Callable[[str], None] | None = None


class FileStore(SharedStore):
    """A directory on a filesystem with POSIX semantics that every replica mounts (Managed Lustre,
    Filestore/NFS, any local directory for one machine).

    * Publish: the object is written to a temporary file in its final directory, fsynced, then
      hard-linked to its name (``link(2)`` fails if the name exists: never replaces an object,
      whichever writer comes second), the temporary name removed and the directory fsynced. A
      reader sees the whole object under its name or nothing; a crash leaves at most a temporary
      file, which the evictor removes once it is an hour old.
    * Read: one open, then the whole file read through that descriptor; the file's mtime is set to
      now (best effort), which is the recency the evictor orders by.
    * Budget (``budget_bytes``; None: none): every writer keeps the usage it last scanned plus what
      it wrote since; above ``high`` of the budget, or ``scan_s`` after its last scan, it scans the
      store under an exclusive ``flock`` on ``<root>/.evict.lock`` taken without waiting (one
      evictor at a time across writers; the others skip and write on), and removes the least
      recently used objects until the usage is at most ``low`` of the budget.
    * An object a reader holds is never taken from it: the evictor only unlinks names, and an open
      file's bytes stay readable until its last descriptor closes (POSIX; Lustre keeps them too).
      The name is gone at once: later lookups miss.
    * Racing writers: each writer sees the others' writes only at its next scan, so the store may
      exceed ``high`` by at most what all writers publish within ``scan_s`` (or until one of them
      crosses ``high`` by its own count); on a filesystem without working ``flock`` two evictors may
      run at once and remove more than needed (the usage drops below ``low``: misses, never a torn
      or wrong object: removal is an unlink of an immutable file).
    """

    kind = "file"

    def __init__(self, root: str, *, budget_bytes: int | None = None, high: float = 0.9, low: float = 0.8,
                 fsync: bool = True, scan_s: float = 10.0, faults: FileFaults | None = None) -> None:
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.high, self.low = high, low
        self.fsync = fsync
        self.scan_s = scan_s
        self.faults = faults or FileFaults()
        self._lock = threading.Lock()  # guards _usage, _written, _scanned_at, evictions
        self._usage = 0  # bytes in the store at the last scan (less what this writer evicted)
        self._written = 0  # bytes this writer published since
        self._scanned_at = float("-inf")
        self.evictions = 0  # objects this writer's evictor removed
        self.scans = 0

    def path(self, name: str) -> str:
        ns, shard, obj = name.split("/")
        return os.path.join(self.root, ns, shard, obj[:2], obj + SUFFIX)

    @override
    def put_if_absent(self, name: str, header: bytes, payload: Any) -> bool:
        final = self.path(name)
        if os.path.exists(final):
            return False
        folder = os.path.dirname(final)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            write_new_file(tmp, [header, payload], self.fsync)
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False  # another writer published it first: theirs stays
            if self.fsync:
                fsync_dir(folder)
        finally:
            unlink_if_present(tmp)
        size = len(header) + memoryview(payload).nbytes
        self._account(size)
        return True

    @override
    def get(self, name: str) -> bytearray | None:
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if self.faults.after_open is not None:
                self.faults.after_open(path)
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            view = memoryview(buf)
            got = 0
            while got < size:
                n = os.preadv(fd, [view[got:]], got)
                if n == 0:
                    break
                got += n
            try:
                os.utime(fd)  # recency for the evictor
            except OSError:
                pass
            return buf if got == size else buf[:got]
        finally:
            os.close(fd)

    @override
    def exists_many(self, names: Sequence[str]) -> list[bool]:
        return [os.path.exists(self.path(n)) for n in names]

    @override
    def delete(self, name: str) -> bool:
        try:
            os.unlink(self.path(name))
            return True
        except FileNotFoundError:
            return False

    # ---------------------------------------------------------------- the budget
    def _account(self, size: int) -> None:
        if self.budget_bytes is None:
            return
        with self._lock:
            self._written += size
            due = (self._usage + self._written > self.high * self.budget_bytes
                   or time.monotonic() - self._scanned_at >= self.scan_s)
        if due:
            self.evict()

    def usage(self) -> int:
        """Bytes of every object and temporary file in the store now (a scan)."""
        return sum(size for _, size, _ in self._scan())

    def evict(self) -> int:
        """One eviction pass if no other writer runs one (see the class doc); returns the objects
        removed. Called by writers; tests call it directly."""
        lock_path = os.path.join(self.root, EVICT_LOCK)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return 0  # another writer is evicting
                raise
            files = self._scan()
            total = sum(size for _, size, _ in files)
            removed = 0
            if self.budget_bytes is not None and total > self.high * self.budget_bytes:
                files.sort()
                target = self.low * self.budget_bytes
                unlink = self.faults.evict_unlink or unlink_if_present
                for _, size, path in files:
                    if total <= target:
                        break
                    unlink(path)
                    total -= size
                    removed += 1
            with self._lock:
                self._usage, self._written, self._scanned_at = total, 0, time.monotonic()
                self.evictions += removed
                self.scans += 1
            return removed
        finally:
            os.close(fd)  # releases the flock

    def _scan(self) -> list[tuple[float, int, str]]:
        """(mtime, bytes, path) of every object and recent temporary file; temporary files older
        than an hour (a writer crashed) are removed."""
        out = []
        stale = time.time() - 3600
        for folder, _, names in os.walk(self.root):
            for name in names:
                if not (name.endswith(SUFFIX) or name.startswith(TMP_PREFIX)):
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if name.startswith(TMP_PREFIX) and st.st_mtime < stale:
                    unlink_if_present(path)
                    continue
                out.append((st.st_mtime, st.st_size, path))
        return out


__all__ = ["FileFaults", "FileStore", "HEADER_BYTES", "ObjectError", "ObjectId", "SharedStore", "SharedURL",
           "StoreUnavailable", "decode_object", "encode_header", "open_store"]
