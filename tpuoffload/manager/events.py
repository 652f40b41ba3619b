"""KV events: what host RAM (and the disk tier) can serve, told as vLLM's own KV cache events.

vLLM drains ``take_events()`` of the scheduler-side connector every step and publishes the events
with its own (``--kv-events-config``) next to the HBM events of its block pool. A router such as
llm-d's precise prefix-cache scorer rebuilds from them, per replica, the set of (block hash, medium)
that replica can serve. This module keeps that set exact:

* ``BlockStored`` (medium "CPU") when a chunk becomes loadable in host RAM, i.e. READY in the
  ``ChunkIndex``: every host confirmed its save (``mark_ready``) or restored it alike (``adopt``);
  never while it is being saved;
* ``BlockRemoved`` when it stops being loadable: evicted, discarded after a failed load, revoked by a
  connector reset (a save that fails or expires was never loadable, so it is never announced);
* the same with medium "STORAGE" for the disk tier's index (a chunk file every host wrote).

The events are self-describing like vLLM's HBM events: each chunk's block hash is vLLM's own hash of
the same tokens (``request.block_hashes``, published as vLLM publishes it: the low 64 bits of the
hash as an int, or its bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), with its parent hash,
token ids, block size, group and LoRA. Chunks that become loadable together and continue each other
go out as one ``BlockStored``, as vLLM groups a request's blocks.

Cost. Whether events are on is decided once, when the scheduler half is built: ``NO_EVENTS``, whose
methods do nothing, is every index's sink otherwise. When on, ``TierEvents`` keeps one fixed-size
record per index entry (hash, parent hash, token ids, group, LoRA: ``EventFormat.row_dtype``), written
by a few numpy calls per save batch; state changes append rows to an ``EventLog``, and the Python
event objects are built once per step in ``EventLog.take``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from typing_extensions import override
import numpy as np

from tpuoffload.manager.hash_table import HashKeys
from tpuoffload.messages import ChunkNews

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

MEDIUM_CPU = "CPU"  # vllm.distributed.kv_events.MEDIUM_CPU
MEDIUM_STORAGE = "STORAGE"  # vllm.distributed.kv_events.MEDIUM_STORAGE


#: Where a run of save candidates comes from, with one KV cache group: ``(request, start, count,
#: group)``, ``count`` consecutive blocks of ``request`` from block ``start``, of ``group``. A plain
#: tuple: the lifecycle builds one per request and step with blocks to save, events on or off.
Origin = tuple


class GroupedOrigins:
    """Where the save candidates of several KV cache groups come from: per span ``(request, block
    ids per group, start, full)``, blocks ``start .. full - 1`` block by block, in each block every
    group whose block is not vLLM's null block, the order ``KVCacheGroups.candidates`` gives them.
    One object per step; the per-candidate layout is computed only for an event sink."""

    __slots__ = ("spans",)

    def __init__(self, spans: Sequence[tuple["Request", Sequence[Sequence[int]], int, int]]) -> None:
        self.spans = spans

    def layout(self) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
        from tpuoffload.manager.kv_groups import NULL_BLOCK

        spans = self.spans
        num_groups = len(spans[0][1])
        ids = np.array([[b for _, block_ids, start, full in spans for b in block_ids[g][start:full]]
                        for g in range(num_groups)], dtype=np.int64).T  # (blocks, groups)
        real = (ids != NULL_BLOCK).reshape(-1)
        lengths = np.array([full - start for _, _, start, full in spans], dtype=np.int64)
        run = np.repeat(np.arange(len(spans)), lengths)
        index = np.concatenate([np.arange(start, full) for _, _, start, full in spans])
        group = np.tile(np.arange(num_groups, dtype=np.int32), len(run))
        return ([r for r, _, _, _ in spans], np.repeat(run, num_groups)[real], np.repeat(index, num_groups)[real],
                group[real])


Origins = Sequence[Origin] | GroupedOrigins


def candidate_layout(origins) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    """(requests, run, index, group) of every candidate of a save batch, in candidate order: the
    candidate is block ``index`` of ``requests[run]``, of KV cache group ``group`` (the one place a
    chunk's group is read)."""
    if isinstance(origins, GroupedOrigins):
        return origins.layout()
    counts = np.fromiter((o[2] for o in origins), dtype=np.int64, count=len(origins))
    starts = np.fromiter((o[1] for o in origins), dtype=np.int64, count=len(origins))
    groups = np.fromiter((o[3] for o in origins), dtype=np.int32, count=len(origins))
    run = np.repeat(np.arange(len(origins)), counts)
    index = starts[run] + np.arange(len(run)) - np.repeat(np.cumsum(counts) - counts, counts)
    return [o[0] for o in origins], run, index, groups[run]


@dataclass(frozen=True)
class EventFormat:
    """What every event of one scheduler half shares: the hash width in bytes (vLLM's hash
    function: 32 for sha256), the block size, whether hashes go out as ints (vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, read once), and each KV cache group's spec kind and
    sliding window (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``)."""

    width: int
    block_size: int
    int_hashes: bool = True
    group_specs: tuple[tuple[str | None, int | None], ...] = ()

    def row_dtype(self) -> np.dtype:
        """One index entry's record."""
        return np.dtype([("hash", np.uint8, (self.width,)), ("parent", np.uint8, (self.width,)),
                         ("has_parent", np.bool_), ("valid", np.bool_), ("group", np.int32), ("lora", np.int32),
                         ("tokens", np.int32, (self.block_size,))])

    def external(self, hashes: np.ndarray) -> list:
        """(n, width) hash bytes as vLLM publishes block hashes (kv_cache_utils.maybe_convert_block_hash):
        the low 64 bits of the big-endian integer, or the bytes."""
        if self.int_hashes:
            return np.ascontiguousarray(hashes[:, -8:]).view(">u8").reshape(-1).tolist()
        buf, w = hashes.tobytes(), self.width
        return [buf[i:i + w] for i in range(0, len(buf), w)]

    def spec_of(self, group: int) -> tuple[str | None, int | None]:
        return self.group_specs[group] if 0 <= group < len(self.group_specs) else (None, None)


@dataclass
class EventLog:
    """The events of one scheduler half since the last ``take``, in the order the index changed:
    ``(medium, stored?, rows)`` batches, built into vLLM's event objects only in ``take``. Shared
    by the host-RAM and disk sinks (one order across media) and holds the LoRA adapters seen."""

    fmt: EventFormat
    _pending: list[tuple[str, bool, np.ndarray]] = field(default_factory=list)
    _loras: list[tuple[int | None, str | None]] = field(default_factory=lambda: [(None, None)])
    _lora_ids: dict[tuple[int, str], int] = field(default_factory=dict)

    def lora_index(self, request: "Request") -> int:
        """A small number for the request's LoRA adapter (0: none), the same for every chunk of it."""
        lora = getattr(request, "lora_request", None)
        return 0 if lora is None else self.lora_of(lora.adapter_id, lora.name)

    def lora_of(self, adapter_id: int, name: str) -> int:
        key = (adapter_id, name)
        idx = self._lora_ids.get(key)
        if idx is None:
            idx = self._lora_ids[key] = len(self._loras)
            self._loras.append(key)
        return idx

    def loras(self) -> list[tuple[int | None, str | None]]:
        """The LoRA adapters numbered so far (``lora_index``), number 0 being none."""
        return list(self._loras)

    def add(self, medium: str, stored: bool, rows: np.ndarray) -> None:
        rows = rows[rows["valid"]] if not rows["valid"].all() else rows
        if len(rows):
            self._pending.append((medium, stored, rows))

    def take(self) -> list["KVCacheEvent"]:
        """Every event since the last call, as vLLM's ``BlockStored`` / ``BlockRemoved``."""
        if not self._pending:
            return []
        from vllm.distributed.kv_events import BlockRemoved

        pending, self._pending = self._pending, []
        out: list = []
        for medium, stored, rows in pending:
            if stored:
                out += self._stored(medium, rows)
                continue
            groups = rows["group"]
            for g in np.unique(groups).tolist():
                part = rows if len(groups) and (groups == g).all() else rows[groups == g]
                out.append(BlockRemoved(block_hashes=self.fmt.external(part["hash"]), medium=medium, group_idx=g))
        return out

    def _stored(self, medium: str, rows: np.ndarray) -> list:
        """One ``BlockStored`` per chain: rows that continue the previous one (its hash is their
        parent, same group and LoRA) join its event, as vLLM's block pool groups a request's blocks."""
        from vllm.distributed.kv_events import BlockStored

        fmt = self.fmt
        hashes, parents, tokens = rows["hash"], rows["parent"], rows["tokens"]
        has_parent, groups, loras = rows["has_parent"], rows["group"], rows["lora"]
        n = len(rows)
        starts = np.ones(n, dtype=bool)
        if n > 1:
            starts[1:] = (~has_parent[1:] | (parents[1:] != hashes[:-1]).any(axis=1)
                          | (groups[1:] != groups[:-1]) | (loras[1:] != loras[:-1]))
        firsts = np.flatnonzero(starts)
        bounds = firsts.tolist() + [n]
        external = fmt.external(hashes)
        parent_of = dict(zip(firsts.tolist(), fmt.external(parents[firsts])))
        bs, flat = fmt.block_size, tokens.reshape(-1).tolist()
        out = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            lora_id, lora_name = self._loras[int(loras[s])]
            group = int(groups[s])
            kind, window = fmt.spec_of(group)
            out.append(BlockStored(
                block_hashes=external[s:e],
                parent_block_hash=parent_of[s] if has_parent[s] else None,
                token_ids=flat[s * bs:e * bs],
                block_size=bs,
                lora_id=lora_id,
                medium=medium,
                lora_name=lora_name,
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            ))
        return out


class ChunkEvents:
    """An index's event sink. This class is the disabled one (``NO_EVENTS``): every method does
    nothing, so an index without events pays one call per batch. ``TierEvents`` is the real one."""

    def bind(self, index: Any) -> None:
        """The index this sink listens to (it may read the index's keys and save ids)."""

    def take_news(self, epoch: int) -> ChunkNews:
        """Under DPScheduler, the READY set's changes since the last call, for the other ranks
        (manager/rank_view.py:RankNews); nothing here."""
        return ChunkNews(epoch)

    def record(self, slots: np.ndarray, positions: np.ndarray, origins: Origins) -> None:
        """New chunks named in ``slots`` (SAVING): candidate ``positions[i]`` of a save batch went to
        ``slots[i]``; the batch's candidates come from ``origins`` (``candidate_layout``)."""

    def rows(self, slots: np.ndarray) -> Any:
        """A copy of the entries' records (for another index: spill, fetch)."""
        return None

    def copy_in(self, slots: np.ndarray, rows: Any) -> None:
        """Entries ``slots`` now hold the chunks ``rows`` describe (from ``rows`` of another index
        or from the restart file)."""

    def ready(self, slots: np.ndarray, save_ids: np.ndarray) -> None:
        """These entries (saved under ``save_ids``) just became loadable (READY)."""

    def removed(self, slots: np.ndarray) -> None:
        """These entries just stopped being loadable (they were READY)."""

    def lookup(self, keys: HashKeys) -> tuple[Any, np.ndarray]:
        """Records the restart file holds for ``keys``: (rows, found mask). Without events every key
        is "found" (nothing to announce)."""
        return None, np.ones(len(keys), dtype=bool)

    @staticmethod
    def subset(rows: Any, idx) -> Any:
        return None if rows is None else rows[idx]

    @staticmethod
    def concat(parts: list) -> Any:
        return None if not parts or parts[0] is None else np.concatenate(parts)


NO_EVENTS = ChunkEvents()


class TierEvents(ChunkEvents):
    """The records of one index's entries and their state changes, for one medium."""

    def __init__(self, log: EventLog, num_entries: int, medium: str, restored: Any = None) -> None:
        self.log = log
        self.fmt = log.fmt
        self.medium = medium
        self._rows = np.zeros(num_entries, dtype=self.fmt.row_dtype())
        self._restored = restored
        self._width_warned = False

    @override
    def record(self, slots: np.ndarray, positions: np.ndarray, origins: Origins) -> None:
        n = len(slots)
        if not n:
            return
        fmt, rows = self.fmt, self._rows
        requests, run, index, group = candidate_layout(origins)
        positions = np.asarray(positions, dtype=np.int64)
        run, index, group = run[positions], index[positions], group[positions]
        # Per request run (Python: two list slices each): its block hashes from the block before
        # its first named chunk to its last, and those blocks' tokens, end to end; one conversion
        # each for the batch. A chunk's hash and its parent's are rows of the first.
        used = np.flatnonzero(np.bincount(run, minlength=len(requests))).tolist()
        cuts = np.searchsorted(run, used)  # ``run`` never decreases: where each used run's chunks begin
        lo_hi = np.stack((np.minimum.reduceat(index, cuts), np.maximum.reduceat(index, cuts)), axis=1).tolist()
        hash_row, token_row = np.zeros(len(requests), np.int64), np.zeros(len(requests), np.int64)
        lora = np.zeros(len(requests), dtype=np.int32)
        bs, hashes, tokens = fmt.block_size, [], []
        for r, (lo, hi) in zip(used, lo_hi):
            request = requests[r]
            below = 1 if lo else 0
            hash_row[r] = len(hashes) + below - lo  # + index: the row of block ``index``'s hash
            token_row[r] = len(tokens) // bs - lo
            hashes += request.block_hashes[lo - below:hi + 1]
            tokens += request.all_token_ids[lo * bs:(hi + 1) * bs]
            lora[r] = self.log.lora_index(request)
        buf = b"".join(hashes)
        if len(buf) != len(hashes) * fmt.width:  # not vLLM's hashes of this deployment: never announced
            rows["valid"][slots] = False
            if not self._width_warned:
                self._width_warned = True
                logger.error("tpuoffload events: block hashes are not all of %d bytes; those chunks are not "
                             "announced", fmt.width)
            return
        hashes = np.frombuffer(buf, dtype=np.uint8).reshape(-1, fmt.width)
        tokens = np.fromiter(tokens, dtype=np.int32, count=len(tokens)).reshape(-1, bs)
        mine = hash_row[run] + index
        has_parent = index > 0
        # Field by field into the records (a whole-record copy through a temporary costs twice).
        rows["hash"][slots] = hashes[mine]
        rows["parent"][slots] = np.where(has_parent[:, None], hashes[np.maximum(mine - 1, 0)], 0)
        rows["tokens"][slots] = tokens[token_row[run] + index]
        rows["group"][slots], rows["lora"][slots] = group, lora[run]
        rows["has_parent"][slots] = has_parent
        rows["valid"][slots] = True

    @override
    def rows(self, slots: np.ndarray) -> np.ndarray:
        return self._rows[slots]

    @override
    def copy_in(self, slots: np.ndarray, rows: np.ndarray) -> None:
        if len(slots):
            self._rows[slots] = rows

    @override
    def ready(self, slots: np.ndarray, save_ids: np.ndarray) -> None:
        """Announced in save order (the ledger resolves newest first), so that a request's chunks
        saved together make one chain."""
        if len(slots) > 1:
            slots = np.asarray(slots)[np.argsort(save_ids, kind="stable")]
        if len(slots):
            self.log.add(self.medium, True, self._rows[slots])

    @override
    def removed(self, slots: np.ndarray) -> None:
        if len(slots):
            self.log.add(self.medium, False, self._rows[slots])

    @override
    def lookup(self, keys: HashKeys) -> tuple[np.ndarray, np.ndarray]:
        """Records of the restart file (event_meta.RestoredMeta) for ``keys``."""
        if self._restored is None:
            return np.zeros(len(keys), dtype=self._rows.dtype), np.zeros(len(keys), dtype=bool)
        return self._restored.lookup(keys)

    def entries(self, slots: np.ndarray) -> np.ndarray:
        """The records of ``slots`` that describe a chunk (for the restart file)."""
        rows = self._rows[slots]
        return rows[rows["valid"]]


def event_format(vllm_config: Any, kv_cache_config: Any) -> EventFormat | None:
    """The scheduler half's ``EventFormat`` when vLLM publishes KV events (``--kv-events-config``
    with ``enable_kv_cache_events``), else None: then nothing is recorded and ``take_events`` is
    empty."""
    kv_events = getattr(vllm_config, "kv_events_config", None)
    if kv_events is None or not kv_events.enable_kv_cache_events:
        return None
    import vllm.envs as envs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    cache = vllm_config.cache_config
    width = len(get_hash_fn_by_name(cache.prefix_caching_hash_algo)(0))
    specs = tuple((get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                  for g in kv_cache_config.kv_cache_groups)
    return EventFormat(width=width, block_size=cache.block_size, int_hashes=envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES,
                       group_specs=specs)
