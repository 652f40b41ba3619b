"""``lazy_offload`` with several KV cache groups (issue 36): a sliding-window hybrid (gpt-oss-like:
sliding-window and full-attention groups sharing one block pool), on vLLM's real Scheduler and KV
cache coordinator, and on tpu-inference's own DPScheduler.

A sliding-window group frees each block that leaves its window while the request runs (vLLM's
``remove_skipped_blocks`` at every ``allocate_slots``), and the next allocation may hand it to
another request, which overwrites it. So a lazy flush may save only the groups vLLM holds until the
finish (full attention); the sliding-window group's blocks are saved in the step of their forward
(``step_saves.py:GroupedLazySaves``, ``KVCacheGroups.held_to_finish``).

The workload makes vLLM free and reuse sliding-window blocks before their request finishes: long
prompts prefilled in chunks (the window leaves the prompt's first blocks during the prefill) and
decoded past the window, several requests at once in a small pool. Then a second wave hits every
first-wave prompt at another boundary (the window tail there lies in blocks freed before the
finish): every group's loaded bytes are checked (``Harness.check_loaded_bytes``,
``check_group_loads``) and every position a step reads (the runner).

Negative control: the one mechanism patched (every group held to the finish: the flush saves the
sliding-window group from the ids it remembered): the blocks vLLM reused meanwhile are saved and
loaded, and the byte checks catch it.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from offload_harness import BS, Harness, rand_tokens

from tpuoffload.manager.kv_groups import KVCacheGroups
from tpuoffload.sim.chaos import Chaos
from tpuoffload.sim.hybrid_layouts import GPT_OSS_LIKE, GPT_OSS_LIKE_DP2, HYBRID_LAYOUTS
from tpuoffload.sim.inproc_slice import InProcSlice
from tpuoffload.sim.podslice import SliceSpec
from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

from test_podslice import _assert_clean_end

# gpt-oss-like with a window of 2 blocks (32 tokens), so short requests leave it many times.
SPEC = dataclasses.replace(GPT_OSS_LIKE, windows=(32, None, 32, None), max_model_len=256)
BLOCKS = 40  # vLLM's blocks for BUDGET (2 arrays of 32 KiB pages per block): freed blocks come back soon
BUDGET = BLOCKS * 2 * 32768
PROMPT_BLOCKS = 8
# Each first-wave prompt (8 blocks and a few tokens) is hit in the second wave at one of these
# boundaries: the window tail (2 blocks) of each lies in blocks the window dropped before the finish.
BOUNDARIES = (8, 6, 4, 2)


class Tables:
    """vLLM's block tables read after every schedule: per schedule, the KV cache group of each
    block id a request holds (``groups``), and how many sliding-window blocks vLLM handed out again
    (to another request, group or position, the dropping request's own later blocks included) while
    the request that dropped them was still running (``reused``)."""

    def __init__(self, h: Harness, windowed: tuple[bool, ...]) -> None:
        self.reused = 0
        self.groups: list[dict[int, int]] = []
        owner: dict[int, tuple[str, int, int]] = {}
        sched = h.eng.scheduler
        kvm = sched.kv_cache_manager
        orig = sched.schedule

        def schedule():
            so = orig()
            group_of = {}
            self.groups.append(group_of)
            for req_id in list(sched.requests):
                try:
                    groups = kvm.get_block_ids(req_id)
                except KeyError:  # not allocated yet
                    continue
                for g, ids in enumerate(groups):
                    for i, b in enumerate(ids):
                        if not b:
                            continue
                        was = owner.get(b)
                        if was is not None and was != (req_id, g, i) and windowed[was[1]] and was[0] in sched.requests:
                            self.reused += 1
                        owner[b] = (req_id, g, i)
                        group_of[b] = g
            return so

        sched.schedule = schedule

    def group_of(self, step: int, block: int) -> int:
        """The group of ``block`` in plan ``step``: in vLLM's tables of that schedule, or (a request
        preempted in it, its blocks freed before the plan) of the one before."""
        got = self.groups[step].get(block)
        return self.groups[step - 1][block] if got is None else got


def run_lazy_workload(seed: int = 0) -> tuple[Harness, KVCacheGroups, list[list[int]], Tables]:
    h = Harness(1, False, max_num_batched_tokens=32, max_num_seqs=4, hybrid=SPEC, kv_budget_bytes=BUDGET,
                extra={"num_cpu_chunks": 128, "lazy_offload": True})
    assert h.eng.scheduler.kv_cache_config.num_blocks == BLOCKS
    groups = KVCacheGroups.of(h.eng.scheduler.kv_cache_config, BS)
    tables = Tables(h, tuple(w is not None for w in groups.windows))
    rng = random.Random(seed)
    prompts = [rand_tokens(rng, PROMPT_BLOCKS * BS + 3) for _ in BOUNDARIES]
    for i, p in enumerate(prompts):
        h.add(f"a{i}", p, max_tokens=24)
    h.run()
    h.new_wave()
    prefixes = [p[:n * BS] for p, n in zip(prompts, BOUNDARIES)]
    for i, p in enumerate(prefixes):
        h.add(f"b{i}", p + rand_tokens(rng, 9))
    h.run()
    return h, groups, prefixes, tables


def test_lazy_flush_saves_full_attention_and_the_window_is_saved_in_its_step():
    """One vLLM Scheduler: sliding-window blocks are dropped and handed out again while their
    requests run; the second wave hits every first-wave prompt at its boundary whole (every group
    a hit needs was saved), every loaded byte of every group is exact, nothing leaks."""
    h, groups, prefixes, tables = run_lazy_workload()
    try:
        assert groups.windows == (2, None), groups.describe()
        assert tables.reused > 0  # the hazard happened: blocks dropped by the window, reused before the finish
        t = h.totals()
        assert t.get("hit_tokens", 0) == sum(len(p) for p in prefixes), t  # every boundary served whole
        h.check_loaded_bytes()
        h.check_group_loads(prefixes, groups.windows, BS)
        # Lazy where it is safe: the full-attention group only in flushes, the window's blocks only
        # in the step of their forward.
        plans = h.metas()
        flushed = {tables.group_of(k, b) for k, p in enumerate(plans) for b in p.flush.block_ids}
        eager = {tables.group_of(k, b) for k, p in enumerate(plans) for b in p.save.block_ids}
        assert flushed == {1} and eager == {0}, (flushed, eager)
        h.check_idle()  # also: no step read a wrong KV value, every finished request released
    finally:
        h.close()


def test_negative_control_a_flush_of_the_windows_remembered_ids_saves_reused_blocks(monkeypatch):
    """The one mechanism removed: every group held to the finish, so the flush saves the
    sliding-window group from the ids remembered while the request ran. Blocks vLLM reused meanwhile
    are saved under the request's keys, loaded by the second wave, and the byte check catches it."""
    monkeypatch.setattr(KVCacheGroups, "held_to_finish", property(lambda self: (True,) * self.num))
    h, _, _, tables = run_lazy_workload()
    try:
        assert tables.reused > 0
        with pytest.raises(AssertionError, match="group 0"):
            h.check_loaded_bytes()
    finally:
        h.close()


# ---------------------------------------------------------------------------- under DPScheduler
# gpt-oss-like with the window above under tpu-inference's DPScheduler, DP 2 x TP 2 on one host of
# 4 devices in this process (InProcSlice). Prompts of 6 prefix blocks and a suffix, prefilled in
# chunks and decoded past the window: by the finish the window has dropped the prefix's first
# blocks, the tail a second-wave hit at the prefix needs among them.
DP_SPEC = dataclasses.replace(GPT_OSS_LIKE_DP2, name="gpt-oss-like-w32-dp2", windows=SPEC.windows)
DP_WORKLOAD = PrefixRepetition(num_prefixes=4, prefix_blocks=6, suffix_len=(8, 16), output_len=(8, 10),
                               num_requests=4, waves=2, arrivals_per_step=0, seed=3)


def test_lazy_offload_with_a_sliding_window_under_dpscheduler(tmp_path, monkeypatch):
    """Each DP rank's scheduler half flushes its own requests' full-attention blocks and saves
    their window's blocks in the step of their forward; the second wave loads every group's chunks
    (across ranks too), every position read is exact, the tokens are right, the dispatch digests
    are equal, nothing leaks."""
    monkeypatch.setitem(HYBRID_LAYOUTS, DP_SPEC.name, DP_SPEC)
    spec = SliceSpec(num_hosts=1, devices_per_host=4, hybrid=DP_SPEC.name, kv_budget_bytes=2 * 48 * 2 * 32768,
                     max_model_len=160, max_num_seqs=4, max_num_batched_tokens=32, step_timeout_s=60.0,
                     extra_config={"num_cpu_chunks": 96, "lazy_offload": True, "save_timeout_s": 30.0})
    pod = InProcSlice(spec, Chaos(), log_dir=str(tmp_path))
    try:
        assert type(pod.scheduler).__name__ == "DPScheduler" and pod.dp_ranks == 2
        res = run_prefix_repetition(pod, DP_WORKLOAD)
        assert res.finished == res.requests and res.wrong_outputs == [], res
        # Every second-wave request loads its whole prefix (6 blocks), both groups: 6 full-attention
        # chunks and the window's 2 (more if a preempted request loads again).
        assert res.per_wave_loaded[1] >= DP_WORKLOAD.num_requests * (6 + 2), res
        assert pod.stats.totals()["cross_rank_chunks_loaded"] > 0, res
        _assert_clean_end(pod)  # every read exact, digests equal at every step, nothing leaked
        print(f"lazy hybrid under DPScheduler: {res}")
    finally:
        pod.close()
