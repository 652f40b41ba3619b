"""Scheduler-side bookkeeping: which host slots hold which chunks, and which hosts confirmed them."""

from tpuoffload.manager.chunk_index import Chunk, ChunkIndex, ChunkState, SaveAllocation
from tpuoffload.manager.ledger import CompletionLedger, Resolution
from tpuoffload.manager.slot_pool import SlotPool
from tpuoffload.manager.staging import StagingBudget

__all__ = [
    "Chunk",
    "ChunkIndex",
    "ChunkState",
    "CompletionLedger",
    "Resolution",
    "SaveAllocation",
    "SlotPool",
    "StagingBudget",
]
