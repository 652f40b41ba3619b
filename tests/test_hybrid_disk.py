"""Issue 21: the disk tier with several KV cache groups (vLLM's hybrid KV cache manager on).

Host RAM holds fewer chunks than a wave saves; the rest spill to disk. A prefix that continues on
disk comes back into host RAM for every group that needs it (a full-attention group every block
of the hit, a sliding-window group the window ending at it), and the hit is one every group can
serve from host RAM and disk together. The gpt-oss-like layout's arrays and vLLM's KV cache config
come from tpu-inference's and vLLM's own code; vLLM's real scheduler drives the connector; every
reloaded block is compared byte for byte with what the synthetic model computes.
"""

from __future__ import annotations

import dataclasses

import pytest
from offload_harness import Harness

from tpuoffload import counters as C
from tpuoffload.manager.kv_groups import KVCacheGroups
from tpuoffload.sim.hybrid_layouts import GPT_OSS_LIKE

SPEC = dataclasses.replace(GPT_OSS_LIKE, max_model_len=1024)
BUDGET = 8 << 20  # vLLM's KV memory: 128 blocks
BS = SPEC.block_size
PREFIX_BLOCKS = (20, 13, 5, 2)  # longer and shorter than the 8-block windows
RAM_CHUNKS = 40  # a wave saves about 80 chunks (40 blocks, two groups): half go to disk


def _run(tmp_path, hosts: int, disk: bool) -> tuple[Harness, list[list[int]]]:
    extra = {"num_cpu_chunks": RAM_CHUNKS}
    if disk:
        extra.update(disk_path=str(tmp_path / "disk-{host}"), disk_bytes_to_use=32 << 20)
    # 128 tokens a step: at most 16 chunks saving at once, so no save is skipped for want of room.
    h = Harness(hosts=hosts, hybrid=SPEC, kv_budget_bytes=BUDGET, extra=extra, max_num_batched_tokens=128)
    # One request at a time: each second-wave prefix (at most 20 + 8 chunks) fits host RAM whole.
    return h, h.two_waves(PREFIX_BLOCKS, seed=5, one_at_a_time=True)


@pytest.mark.parametrize("hosts", [1, 2])
def test_prefixes_of_every_group_come_back_from_disk_byte_exact(tmp_path, hosts):
    h, prefixes = _run(tmp_path, hosts, disk=True)
    try:
        groups = KVCacheGroups.of(h.eng.scheduler.kv_cache_config, BS)
        assert groups.several and groups.windowed
        t = h.totals()
        assert t.get(C.SPILLS_CONFIRMED, 0) > 0 and t.get(C.FETCHES_ISSUED, 0) > 0, t
        assert t.get(C.FETCHES_FAILED, 0) == 0 and t.get(C.SKIPPED_NO_SPACE, 0) == 0, t
        # Every second-wave prefix is served whole, from host RAM and disk together.
        assert t.get(C.HIT_TOKENS, 0) == sum(len(p) for p in prefixes), t
        assert h.check_loaded_bytes() > 0
        h.check_idle()  # also: no step read a wrong KV value, nothing pinned or in flight
        # Per load: the full-attention group every hit block, the sliding-window group its tail.
        h.check_group_loads(prefixes, groups.windows, BS)
    finally:
        h.close()


def test_without_the_disk_tier_the_same_workload_misses():
    """The control: host RAM alone cannot serve the second wave whole (what the disk tier adds)."""
    h, prefixes = _run(None, 1, disk=False)
    try:
        t = h.totals()
        assert t.get(C.FETCHES_ISSUED, 0) == 0
        assert t.get(C.HIT_TOKENS, 0) < sum(len(p) for p in prefixes), t
        h.check_idle()
    finally:
        h.close()
