"""The scheduler half of the connector (vLLM's engine-core process): decides what to save and load.

``OffloadScheduler`` (offload_scheduler.py) is the only class vLLM's hooks reach; the modules
beside it each hold one job (see its docstring). ``topology`` answers how many worker processes
report and how many bytes each stores per chunk.
"""

from tpuoffload.manager.offload_scheduler import OffloadScheduler

__all__ = ["OffloadScheduler"]
