"""A burst of prefix hits on a GDN hybrid never takes every state row (manager/admission.py).

tpu-inference's hybrid coordinator keeps GDN/mamba state rows in a compact pool that vLLM's
reservation for in-flight async loads does not cover. Each request admitted with a load takes a
row and keeps it until it runs; when a burst of hits takes every row, no loaded request finds the
row of its next block, nothing runs, and the engine never finishes a step again. The connector's
scheduler half admits at most ``StateRowLimit.limit`` loads that have not run yet, and answers
"ask again" to the next hit.

What runs: vLLM's real Scheduler with tpu-inference's own ``TPUHybridKVCacheCoordinator`` and
compact pool (16 rows: ``test_gdn_lazy.SPEC``), the workload of ``test_gdn_lazy.two_waves``, whose
second wave is 22 prefix hits at once. Negative control: the one mechanism removed (every load
admitted, as before) and the same burst leaves the engine stuck with loaded requests waiting.
"""

from __future__ import annotations

import types

import pytest

from tpuoffload.manager.admission import NO_LIMIT, StateRowLimit, load_admission
from tpuoffload.manager.kv_groups import MIRROR, STATE_POOL, KVCacheGroups

from test_gdn_offload import EXTRA, _check_clean, _engine
from test_gdn_lazy import SPEC, two_waves

BS = SPEC.block_size
# Host RAM for every chunk of the first wave: every second-wave request hits.
RAM = {**EXTRA, "num_cpu_chunks": 512}


def test_a_burst_of_hits_waits_its_turn_and_every_request_is_served_whole():
    eng = _engine(extra=RAM, spec=SPEC)
    try:
        admission = eng.offload.admission
        assert isinstance(admission, StateRowLimit) and admission.limit == 8  # 16 rows less 4 x 2 running
        most = []
        orig = eng.step

        def step():
            orig()
            most.append(admission.waiting)
        eng.step = step
        prefixes = two_waves(eng, max_steps=400)
        t = eng.stats.reduce()
        assert t.get("hit_tokens", 0) == sum(len(p) for p in prefixes), t  # every hit served, none dropped
        assert t.get("loads_deferred", 0) > 0 and max(most) == admission.limit, (t, max(most))
        assert admission.waiting == 0
        _check_clean(eng)  # every state row and attention position read exact, nothing held
    finally:
        eng.close()


def test_negative_control_every_load_admitted_takes_every_state_row_and_the_engine_stops(monkeypatch):
    from tpuoffload import connector

    monkeypatch.setattr(connector, "load_admission", lambda *a: NO_LIMIT)
    eng = _engine(extra=RAM, spec=SPEC)
    try:
        with pytest.raises(RuntimeError, match="not idle after 400 steps"):
            two_waves(eng, max_steps=400)
        sched = eng.scheduler
        assert not sched.running  # nothing runs ...
        stuck = list(sched.kv_holding_waiting)  # ... while loaded requests hold every row
        assert len(stuck) > 8 and any(r.num_computed_tokens > 0 for r in stuck), stuck
    finally:
        eng.close()


# ---------------------------------------------------------------------------- the rule
def _config(max_num_seqs=4, spec_tokens=None):
    spec = None if spec_tokens is None else types.SimpleNamespace(num_speculative_tokens=spec_tokens)
    return types.SimpleNamespace(speculative_config=spec,
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=max_num_seqs))


GDN = KVCacheGroups(windows=(1, MIRROR, None), pools=(STATE_POOL, STATE_POOL, 0))


def test_the_limit_leaves_a_full_batch_its_rows_and_is_never_below_one():
    rows = types.SimpleNamespace(mamba_num_blocks=17)
    assert load_admission(_config(), rows, GDN).limit == 16 - 4 * 2
    assert load_admission(_config(spec_tokens=1), rows, GDN).limit == 16 - 4 * 3
    assert load_admission(_config(max_num_seqs=16), rows, GDN).limit == 1
    # No compact pool (vLLM's own coordinator reserves for loads) or no state group: no limit.
    assert load_admission(_config(), types.SimpleNamespace(), GDN) is NO_LIMIT
    assert load_admission(_config(), rows, KVCacheGroups()) is NO_LIMIT
    with pytest.raises(ValueError, match="would admit no load"):
        StateRowLimit(0)


def test_a_request_stops_counting_once_it_runs_or_finishes():
    a = StateRowLimit(2)
    a.admitted("x")
    a.admitted("y")
    assert not a.may_load() and a.waiting == 2
    a.ran({"x": 16})
    assert a.may_load() and a.waiting == 1
    a.finished("y")  # aborted while it waited
    a.finished("y")
    assert a.waiting == 0
    assert NO_LIMIT.may_load() and NO_LIMIT.waiting == 0
