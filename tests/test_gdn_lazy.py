"""``lazy_offload`` with GDN state pools (issue 36), on vLLM's real ``Scheduler`` and
``AsyncScheduler`` with tpu-inference's hybrid coordinator and arrays (``tpuoffload.sim.gdn_layout``,
as ``test_gdn_offload.py`` runs them).

vLLM's mamba cache mode "align" leaves the state after a block boundary in the request's state row
only in the step that computes it: the next steps overwrite that row, or vLLM frees it and hands it
to another request. A flush at the finish or a preemption would save whatever the row holds then.
So lazy mode saves the state rows in the step of their forward, as eager mode does, and only the
attention groups, which vLLM holds until the finish, wait for the flush
(``KVCacheGroups.held_to_finish``, ``step_saves.GroupedLazySaves``).

The workload (``test_gdn_offload._waves``): prompts of whole blocks and a short tail, so vLLM's
align mode ends a prefill step exactly at the prompt's last full block and its state is saved
there; decode steps then overwrite that row. The second wave, with vLLM's prefix cache reset and
every array wiped, hits each prompt from host RAM; the synthetic GDN runner checks every state row
and attention position a step reads.

Negative control: the one mechanism removed (every group held to the finish): the flush saves the
state rows remembered while the request ran, which later steps overwrote; the second wave reads
wrong states and the runner counts them.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tpuoffload.manager.kv_groups import KV_POOL, NULL_BLOCK, STATE_POOL, KVCacheGroups
from tpuoffload.sim import gdn_layout as gl

from test_gdn_offload import BS, EXTRA, VARIANTS, _check_clean, _engine, _tokens, _wipe

# Host RAM for every chunk of the first wave (no eviction: every prefix can be hit).
LAZY = {**EXTRA, "num_cpu_chunks": 512, "lazy_offload": True}
# A small HBM: tpu-inference sizes the compact state pool from it (16 rows and the null row).
SPEC = dataclasses.replace(gl.QWEN35_LIKE, max_num_seqs=4, max_num_batched_tokens=256, hbm_bytes=10 << 20)
# (prefix blocks, output tokens) of the first wave, in arrival order: two requests decode long
# (one token of tail and 14 generated stay inside the prompt's next block), while 20 short ones
# pass through the other two places of the batch. vLLM puts a freed state row that holds a cached
# prefix state at the back of its free queue; the short requests use up the rest of the 16 rows
# and so reach the long requests' prompt rows, freed after their prefill, before they finish.
FIRST_WAVE = ((6, 14), (5, 14)) + ((1, 1),) * 20


class Rows:
    """vLLM's state rows read after every schedule: how many rows vLLM handed to another request
    while the request that held one before was still running (``reused``), the hazard of a flush
    of remembered rows."""

    def __init__(self, eng, state_group: int) -> None:
        self.reused = 0
        sched = eng.scheduler
        kvm = sched.kv_cache_manager
        orig = sched.schedule
        owner: dict[int, str] = {}

        def schedule():
            so = orig()
            for req_id in list(sched.requests):
                try:
                    rows = kvm.get_block_ids(req_id)[state_group]
                except KeyError:  # not allocated yet
                    continue
                for row in rows:
                    if row == NULL_BLOCK:
                        continue
                    was = owner.get(row)
                    if was is not None and was != req_id and was in sched.requests:
                        self.reused += 1
                    owner[row] = req_id
            return so

        sched.schedule = schedule


def two_waves(eng, seed: int = 0, max_steps: int = 10_000) -> list[list[int]]:
    """Two waves over the same prefixes (module doc). First wave: ``FIRST_WAVE``, each prompt its
    prefix and one token. Second wave, after vLLM's prefix cache reset and every array wiped: each
    prefix and a short tail, all at once (22 hits: tests/test_gdn_admission.py). Returns the
    prefixes; raises RuntimeError when a wave has not ended after ``max_steps`` steps."""
    rng = random.Random(seed)
    layout = eng.gdn_layout
    prefixes = [_tokens(rng, n * BS) for n, _ in FIRST_WAVE]
    for w, (tail, outs) in enumerate(((1, [out for _, out in FIRST_WAVE]), (7, [3] * len(prefixes)))):
        if w:
            assert eng.scheduler.reset_prefix_cache()
            _wipe(eng)
        for i, (p, out) in enumerate(zip(prefixes, outs)):
            eng.add_request(gl.make_request(layout, f"{w}{i:02}", p + _tokens(rng, tail), max_tokens=out))
        eng.run(max_steps)
        eng.settle()
    return prefixes


def _plans(eng) -> list:
    """Every (host, StepPlan) the workers were handed."""
    seen = []
    for host, conn in enumerate(eng.connectors):
        orig = conn.bind_connector_metadata

        def bind(meta, orig=orig, host=host):
            seen.append((host, meta.plan))
            return orig(meta)

        conn.bind_connector_metadata = bind
    return seen


def _pools(eng, plans, part: str) -> set[int]:
    """The slot pools of the chunks every host-0 plan's ``part`` ("save" or "flush") copies."""
    pool_of = eng.offload.index.pool_of
    return {int(p) for host, plan in plans if host == 0 and len(getattr(plan, part))
            for p in pool_of(np.asarray(list(getattr(plan, part).slots), np.int64))}


@pytest.mark.parametrize("async_scheduling", VARIANTS)
def test_lazy_offload_saves_state_rows_in_their_step_and_attention_at_the_finish(async_scheduling):
    """Every second-wave prompt is served whole from host RAM (its attention blocks and the state
    row at its boundary), every state row and attention position read is exact; state rows went
    only in the step of their forward, attention chunks only in flushes."""
    eng = _engine(async_scheduling, extra=LAZY, spec=SPEC)
    try:
        groups = eng.offload.kv_groups
        assert groups.held_to_finish == (False, False, False, True)
        rows, plans = Rows(eng, groups.state_group), _plans(eng)
        prefixes = two_waves(eng)
        assert rows.reused > 0  # the hazard happened: rows freed and handed out before their owner finished
        t = eng.stats.reduce()
        assert t.get("hit_tokens", 0) == sum(len(p) for p in prefixes), (t, eng.offload.index.pool_sizes)
        pool_of = eng.offload.index.pool_of  # a slot's pool is fixed: read after the run
        for load in (ld for host, plan in plans for ld in plan.loads):
            pools = pool_of(np.asarray(list(load.slots), np.int64))
            n = len(prefixes[int(load.req_id[1:])]) // BS
            assert sorted(pools.tolist()) == [KV_POOL] * n + [STATE_POOL], (load.req_id, pools)
        # Lazy where it is safe: attention chunks only in flushes, state rows only in their step.
        assert _pools(eng, plans, "flush") == {KV_POOL} and _pools(eng, plans, "save") == {STATE_POOL}
        runner = eng.runners[0]
        assert runner.stats.states_verified >= len(prefixes)
        _check_clean(eng)  # no wrong state or attention read, nothing held
    finally:
        eng.close()


def test_negative_control_a_flush_of_the_remembered_state_rows_saves_overwritten_states(monkeypatch):
    """The one mechanism removed: every group held to the finish, so the flush saves the state
    group from the rows remembered while each request ran, which its decode steps overwrote.
    The second wave loads those rows as the prefixes' states, and the runner catches it."""
    monkeypatch.setattr(KVCacheGroups, "held_to_finish", property(lambda self: (True,) * self.num))
    eng = _engine(extra=LAZY, spec=SPEC)
    try:
        rows = Rows(eng, eng.offload.kv_groups.state_group)
        two_waves(eng)
        assert rows.reused > 0
        st = eng.runners[0].stats
        assert st.state_mismatches > 0, (st.states_verified, st.state_mismatches)
    finally:
        eng.close()
