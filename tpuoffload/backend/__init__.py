"""What stores offloaded chunks, or stands for them, on a worker: the slot table (what each host-RAM
slot holds; the bytes are in the transfer engine's stores) and the disk tier."""

from tpuoffload.backend.slot_table import SlotTable

__all__ = ["SlotTable"]
