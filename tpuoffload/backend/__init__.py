"""What stores offloaded chunks, or stands for them, on a worker: the slot table (what each host-RAM
slot holds; the bytes are in the transfer engine's stores) and the disk tier."""

from tpuoffload.backend.slot_table import SHARD_SPARE_ROWS, SlotTable

__all__ = ["SHARD_SPARE_ROWS", "SlotTable"]
