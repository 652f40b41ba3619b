"""Messages between the scheduler half and the worker halves, one of each per engine step.

``OffloadMetadata`` crosses the network to every host every step, so it is kept compact: a save
batch's save ids are one ``range`` (the scheduler hands them out contiguously), its slots a
``range`` when they are consecutive (usually) or else a tuple, block ids are tuples of ints. ``metadata_bytes`` measures it the way vLLM's executors ship it (pickle).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class LoadRequest:
    """One request's prefix hit: host slots to copy into its blocks. ``unavailable_block_ids`` are
    blocks the scheduler promised but could not pin; workers report them as load errors."""

    req_id: str
    block_ids: tuple[int, ...]
    slots: Sequence[int]  # a range when consecutive (usually), else a tuple
    save_ids: Sequence[int]  # likewise
    unavailable_block_ids: tuple[int, ...] = ()


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """The same object reaches every worker each step; workers act on nothing else."""

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


def _merge_maps(x: dict[int, tuple[Range, ...]], y: dict[int, tuple[Range, ...]]) -> dict[int, tuple[Range, ...]]:
    out = dict(x)
    for host, ranges in y.items():
        out[host] = merge_ranges(out.get(host, ()), ranges)
    return out


@dataclass
class OffloadWorkerReport(KVConnectorWorkerMetadata):
    """Save outcomes of one or more hosts: ``saved[host]`` and ``failed[host]`` are ranges of save
    ids. Merging is a union per host, so a report merged twice counts once (idempotent, order-free)
    while the same save confirmed by two hosts stays two confirmations.

    Build one with ``OffloadWorkerReport.from_host(host, saved_ids, failed_ids)``; the scheduler's
    ledger applies a range with a few array operations, not per save id.
    """

    saved: dict[int, tuple[Range, ...]] = field(default_factory=dict)
    failed: dict[int, tuple[Range, ...]] = field(default_factory=dict)

    @classmethod
    def from_host(cls, host: int, saved_ids: Iterable[int] = (), failed_ids: Iterable[int] = ()) -> "OffloadWorkerReport":
        saved, failed = id_ranges(saved_ids), id_ranges(failed_ids)
        return cls({host: saved} if saved else {}, {host: failed} if failed else {})

    def __len__(self) -> int:
        """Save outcomes carried (a host's confirmation of a save counts one)."""
        return sum(b - a for m in (self.saved, self.failed) for rs in m.values() for a, b in rs)

    def hosts(self) -> set[int]:
        return set(self.saved) | set(self.failed)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "OffloadWorkerReport":
        """Invariant 7: a union per host, idempotent and order-free (vLLM's KVOutputAggregator
        merges the workers' reports with it)."""
        assert isinstance(other, OffloadWorkerReport), type(other)
        return OffloadWorkerReport(_merge_maps(self.saved, other.saved), _merge_maps(self.failed, other.failed))
