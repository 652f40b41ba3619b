"""Messages between the scheduler half and the worker halves, one of each per engine step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class SaveBatch:
    """Chunks to copy from KV-cache blocks into host slots (position i of each tuple is chunk i)."""

    block_ids: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    save_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class LoadRequest:
    """One request's prefix hit: host slots to copy into its blocks. ``unavailable_block_ids`` are
    blocks the scheduler promised but could not pin; workers report them as load errors."""

    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    save_ids: tuple[int, ...]
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


@dataclass
class OffloadWorkerReport(KVConnectorWorkerMetadata):
    """Save outcomes, keyed (host, save_id, ok). Merging is a Counter union, so a report merged twice
    counts once while the same chunk confirmed by two hosts stays two confirmations."""

    results: Counter = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "OffloadWorkerReport":
        return OffloadWorkerReport(self.results | other.results)
