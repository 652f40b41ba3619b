"""Warm restart through orbax-checkpoint (checkpoint.py) and the operator's checkpoint requests
(request.py). See docs/persistence.md."""

from tpuoffload.persist.checkpoint import (
    FORMAT_VERSION,
    Fingerprint,
    PersistFaults,
    Persister,
    PoolSlots,
    Restored,
    SaveHandle,
    SaveReport,
    read_index,
)
from tpuoffload.persist.request import CheckpointDone, CheckpointRequest, RequestWatcher, request_checkpoint

__all__ = ["FORMAT_VERSION", "CheckpointDone", "CheckpointRequest", "Fingerprint", "PersistFaults", "Persister",
           "PoolSlots", "RequestWatcher", "Restored", "SaveHandle", "SaveReport", "read_index", "request_checkpoint"]
