"""KV events across a warm restart: the records that describe each chunk, kept beside the checkpoints.

A checkpoint is written by the hosts and holds each slot's hash keys only (the first 16 bytes of the
hash), so after a restart the scheduler could not say which block hash, tokens and parent a
restored chunk has. With KV events on, the scheduler half writes its own file, ``META_FILE`` in
``persist_path``: the event record (manager/events.py ``EventFormat.row_dtype``) of every chunk
named in host RAM or on disk, whenever a checkpoint is planned and at shutdown (after the hosts'
shutdown checkpoint: vLLM shuts its executor down first). At the next start, a restored chunk or
chunk file is looked up there by its hash keys: found, it is adopted and announced with exactly
the record it was saved with; not found (the file is older than the checkpoint, or missing), it is
not made loadable, so the events stay exact (counted with the restored chunks dropped).

The record of a hash never changes (the hash covers the tokens and the parent), so any file of the
same deployment describes the chunks it names correctly. Under DPScheduler every rank's half writes
its own file (``meta_file``: ranks sharing one file overwrote each other's records, and at the next
start the other ranks' restored chunks were dropped), and a half reads every file in ``persist_path``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable

import numpy as np

from tpuoffload.manager.events import EventLog
from tpuoffload.manager.hash_table import HashKeys, PackedHashes
from tpuoffload.manager.kv_groups import chunk_keys

logger = logging.getLogger(__name__)

META_FILE = "kv-events-meta.npz"
_META_FILES = re.compile(r"kv-events-meta(-dp\d+)?\.npz")


def meta_file(dp_rank: int | None) -> str:
    """The file a half writes: ``META_FILE``, or under DPScheduler its rank's."""
    return META_FILE if dp_rank is None else f"kv-events-meta-dp{dp_rank}.npz"


class RestoredMeta:
    """The records a previous run wrote, looked up by the keys the indexes hold (the content hash,
    mixed with the KV cache group: kv_groups.chunk_keys)."""

    def __init__(self, rows: np.ndarray, log: EventLog) -> None:
        k1, k2 = np.zeros(len(rows), np.uint64), np.zeros(len(rows), np.uint64)
        for g in np.unique(rows["group"]).tolist():
            mine = rows["group"] == g
            packed = PackedHashes(np.ascontiguousarray(rows["hash"][mine]).tobytes(), log.fmt.width)
            keys = HashKeys.of(chunk_keys(packed, g))
            k1[mine], k2[mine] = keys.k1, keys.k2
        order = np.lexsort((k2, k1))
        self._k1, self._k2 = k1[order], k2[order]
        self._rows = rows[order]

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, keys: HashKeys) -> tuple[np.ndarray, np.ndarray]:
        """(records, found): the record of each key (an arbitrary one where not found)."""
        if not len(self._k1):
            return np.zeros(len(keys), dtype=self._rows.dtype), np.zeros(len(keys), dtype=bool)
        pos = np.minimum(np.searchsorted(self._k1, keys.k1), len(self._k1) - 1)
        found = (self._k1[pos] == keys.k1) & (self._k2[pos] == keys.k2)
        return self._rows[pos], found


def save_meta(path: str, rows: np.ndarray, log: EventLog, name: str = META_FILE) -> None:
    """Write ``rows`` for the next start, atomically (a temporary file renamed over the last)."""
    os.makedirs(path, exist_ok=True)
    final = os.path.join(path, name)
    tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp.npz"
    header = {"width": log.fmt.width, "block_size": log.fmt.block_size}
    np.savez(tmp, rows=rows, loras=np.array(json.dumps(log.loras())), header=np.array(json.dumps(header)))
    os.replace(tmp, final)


def load_meta(path: str, log: EventLog) -> RestoredMeta | None:
    """The records ``save_meta`` wrote under ``path``, every file's (each rank's under DPScheduler);
    None if there are none. A file of another deployment or unreadable is left out (one log line
    says which)."""
    names = sorted(n for n in os.listdir(path) if _META_FILES.fullmatch(n)) if os.path.isdir(path) else []
    parts = [rows for rows in (_load_file(os.path.join(path, n), log) for n in names) if rows is not None]
    return RestoredMeta(np.concatenate(parts), log) if parts else None


def _load_file(final: str, log: EventLog) -> np.ndarray | None:
    """One file's records, their LoRA numbers this run's."""
    try:
        with np.load(final, allow_pickle=False) as f:
            header = json.loads(str(f["header"]))
            rows, loras = f["rows"], json.loads(str(f["loras"]))
    except Exception as e:  # never stop the engine for it: restored chunks are then not adopted
        logger.warning("tpuoffload events: %s unreadable (%s: %s); restored chunks will not be loadable",
                       final, type(e).__name__, e)
        return None
    fmt = log.fmt
    if header != {"width": fmt.width, "block_size": fmt.block_size} or rows.dtype != fmt.row_dtype():
        logger.warning("tpuoffload events: %s is of another deployment (%s); not used", final, header)
        return None
    # The old run's LoRA numbers -> this run's.
    remap = np.array([0] + [log.lora_of(*k) for k in loras[1:]], dtype=np.int32)
    rows["lora"] = remap[rows["lora"]]
    return rows


class MetaWriter:
    """Writes the records of every named chunk (``records()``) to ``path``: the copy on the caller's
    thread (a few numpy calls), the file on a background thread, one write at a time."""

    def __init__(self, path: str, log: EventLog, records: Callable[[], np.ndarray],
                 name: Callable[[], str | None] = lambda: META_FILE) -> None:
        self.path = path
        self.log = log
        self.records = records
        self.name = name  # the file's (None: nothing to write yet)
        self._thread: threading.Thread | None = None

    def write(self) -> None:
        """Start writing the current records (after the previous write finished)."""
        self.wait()
        name = self.name()
        if name is None:
            return
        rows = self.records()
        self._thread = threading.Thread(target=self._write, args=(rows, name), name="tpuoffload-event-meta",
                                        daemon=True)
        self._thread.start()

    def _write(self, rows: np.ndarray, name: str) -> None:
        try:
            save_meta(self.path, rows, self.log, name)
        except OSError as e:
            logger.warning("tpuoffload events: could not write %s (%s)", os.path.join(self.path, name), e)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Shutdown: the records as they are now, written before returning."""
        self.write()
        self.wait()


class NoMetaWriter:
    """Without KV events (or without warm restart) nothing is written."""

    def write(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_META_WRITER = NoMetaWriter()
