"""Worker-side storage of this host's shard of every offloaded chunk."""

from tpuoffload.backend.host_backend import HostBackend, SlotMismatch

__all__ = ["HostBackend", "SlotMismatch"]
