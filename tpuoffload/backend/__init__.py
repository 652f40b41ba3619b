"""Worker-side storage of this host's part of every offloaded chunk."""

from tpuoffload.backend.host_backend import HostBackend

__all__ = ["HostBackend"]
