"""Pod slice: N JAX processes (gloo on CPU), one globally agreed dispatch order, chaos without corruption.

Every test starts real worker processes (tpuoffload.sim.podslice), so every test runs under an
outside timeout and checks afterwards that no worker process (group) is left. The harness itself
compares the per-host dispatch digests and sampled tokens at every step; the runner verifies every
context position it reads; the workload driver checks every generated token.
"""

from __future__ import annotations

import dataclasses

import os
import signal
import time

import pytest

from tpuoffload.sim.podslice import DigestMismatch, MisplacedDispatch, PodSlice, SliceError, SliceSpec
from tpuoffload.sim.chaos import Chaos, PointFaults
from tpuoffload.sim.dispatch_marks import misplaced_op
from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition
from tpuoffload.sim.vllm_setup import assert_scheduler_empty

from conftest import assert_gone

# A prefix_repetition workload: 4 prefixes x 12 blocks of 16 tokens, 8-16 token suffixes, 4-8
# output tokens, 24 requests per wave, 2 waves with reset_prefix_cache() between them.
WORKLOAD = PrefixRepetition(num_prefixes=4, prefix_blocks=12, suffix_len=(8, 16), output_len=(4, 8),
                            num_requests=24, waves=2, arrivals_per_step=4, seed=0)


def _spec(num_hosts: int, devices_per_host: int, num_blocks: int, **extra) -> SliceSpec:
    config = {"cpu_bytes_to_use": 1 << 22, "save_timeout_s": 3.0, "load_wait_timeout_s": 2.0, **extra}
    return SliceSpec(num_hosts=num_hosts, devices_per_host=devices_per_host, num_kv_heads=8,
                     num_blocks=num_blocks, max_num_seqs=16, max_num_batched_tokens=256,
                     extra_config=config, step_timeout_s=60.0)


def _assert_clean_end(pod: PodSlice) -> list[dict]:
    """No hang, nothing leaked, no corruption, identical digests on every host at every step."""
    for report in pod.leak_reports():  # the scheduler half, or each DP rank's (DPScheduler)
        assert all(v == 0 for k, v in report.items() if k != "source"), report
    if pod.dp_ranks == 1:
        assert_scheduler_empty(pod.scheduler)
    else:
        assert pod.scheduler.get_num_unfinished_requests() == 0 and not pod.scheduler.assigned_dp_rank
    states = pod.worker_state()
    assert len(states) == pod.spec.num_hosts
    for host, (state, start) in enumerate(zip(states, pod.start_state)):
        assert state["mismatches"] == 0, (state, pod.first_mismatch_step)  # every read of every step
        assert state["positions_verified"] > 0, state
        assert state["inflight_chunks"] == 0 and state["staging_bytes"] == 0, state
        assert state["backend_bytes"] == start["backend_bytes"], (state, start)
        assert state["idle"], state
    assert len(pod.digests) == pod.steps
    assert all(len(set(step)) == 1 and len(step) == pod.spec.num_hosts for step in pod.digests)
    return states


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_hosts,devices_per_host", [(2, 2)])  # 4 hosts: the qwen3-coder chaos run below
def test_prefix_repetition(make_slice, num_hosts, devices_per_host):
    # 48 blocks cannot hold the 4 x 12 prefix blocks and the requests running on them.
    pod = make_slice(_spec(num_hosts, devices_per_host, num_blocks=48))
    res = run_prefix_repetition(pod, WORKLOAD)
    assert res.requests == 2 * WORKLOAD.num_requests
    assert res.finished == res.requests and res.aborted == 0
    assert res.wrong_outputs == []
    totals = pod.stats.totals()
    assert totals["chunks_saved"] > 0 and totals["chunks_loaded"] > 0, res.stats
    assert res.per_wave_loaded[1] > 0, "the wave after reset_prefix_cache() must load from host RAM"
    assert totals["load_errors"] == 0 and totals["save_failures"] == 0, res.stats
    # Every host saved and loaded the same chunks (its own heads of them).
    assert totals["chunks_loaded"] % num_hosts == 0
    _assert_clean_end(pod)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_hosts,devices_per_host", [(2, 1)])  # 4 hosts x 4 devices: the qwen3-coder run
def test_prefix_repetition_chaos(make_slice, num_hosts, devices_per_host):
    # Per-host random write and step delays, a persistently slow host, failed device-to-host copies
    # on host 0, slots lost on host 1 (load errors: vLLM recomputes on every host), dropped and
    # doubled reports, random aborts; a tiny block pool for preemption storms.
    chaos = Chaos.storm(num_hosts, seed=7)
    pod = make_slice(_spec(num_hosts, devices_per_host, num_blocks=28), chaos)
    res = run_prefix_repetition(pod, WORKLOAD)
    assert res.finished + res.aborted == res.requests, res
    assert res.aborted > 0 and pod.preemptions > 0, (res.aborted, pod.preemptions)
    assert pod.preemptions == pod.vllm_preemptions  # the connector counts every preemption vLLM reported
    assert res.wrong_outputs == []
    totals = pod.stats.totals()
    assert totals["chunks_loaded"] > 0, res.stats
    assert totals["load_errors"] > 0 and totals["save_failures"] > 0, res.stats
    _assert_clean_end(pod)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_qwen3_coder_480b_layout_four_hosts_chaos(make_slice):
    """configs/qwen3-coder-480b-multihost: fp8, tensor parallel 16, 8 KV heads, as tpu-inference's
    create_kv_caches lays it out over its runner's mesh, spread over 4 processes x 4 devices."""
    spec = _spec(4, 4, num_blocks=32)
    spec.layout = "qwen3-coder-480b-fp8-tp16"
    pod = make_slice(spec, Chaos.storm(4, seed=3))
    res = run_prefix_repetition(pod, WORKLOAD)
    assert res.finished + res.aborted == res.requests and res.wrong_outputs == []
    assert res.aborted > 0 and pod.preemptions > 0, (res.aborted, pod.preemptions)  # the storm reached 4 hosts
    totals = pod.stats.totals()
    assert totals["chunks_saved"] > 0 and totals["chunks_loaded"] > 0, res.stats
    assert totals["load_errors"] > 0 and totals["save_failures"] > 0, res.stats
    _assert_clean_end(pod)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", ["LOAD_SLOT_CHECK", "LOAD_PREPARE", "SAVE_PROGRAM", "SAVE_RECORD"])
def test_exception_at_each_fault_point_on_one_host(make_slice, point):
    """Invariant 2 (issue 12): host 1 raises at one fault point half the time; every host still
    issues identical programs at every step (the harness compares digests), the outputs are exact,
    and the failures are reported and counted."""
    pod = make_slice(_spec(2, 1, num_blocks=48), point_faults=PointFaults(host=1, rate=0.5, points=(point,)))
    res = run_prefix_repetition(pod, dataclasses.replace(WORKLOAD, num_requests=12))  # half the waves: 4 points
    assert res.finished == res.requests and res.wrong_outputs == []
    totals = pod.stats.totals()
    counter = "load_errors" if point in ("LOAD_SLOT_CHECK", "LOAD_PREPARE") else "save_failures"
    assert totals[counter] > 0, res.stats
    _assert_clean_end(pod)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_host_order_is_caught(make_slice):
    """Negative control: host 1 gathers its blocks in another order. Same data, other programs."""
    pod = make_slice(_spec(2, 1, num_blocks=48), Chaos(broken="host_order"))
    with pytest.raises(DigestMismatch) as err:
        run_prefix_repetition(pod, WORKLOAD)
    msg = str(err.value)
    assert f"diverge at step {pod.steps}" in msg  # the diverging step
    assert "host 0:" in msg and "host 1:" in msg
    assert msg.count("save shape") >= 2  # both hosts' ops are shown
    assert ">>" in msg  # the first differing op is marked


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_background_dispatch_is_caught(make_slice):
    """Negative control: gather + device_put issued from a background thread. The harness must name
    it: ops outside the hooks that may dispatch (MisplacedDispatch) or digests that diverge
    (DigestMismatch), never an unrelated crash or hang."""
    pod = make_slice(_spec(2, 1, num_blocks=48, save_timeout_s=2.0), Chaos(broken="background_dispatch"))
    pod.spec.step_timeout_s = 30.0
    with pytest.raises(DigestMismatch) as err:  # MisplacedDispatch is a DigestMismatch
        run_prefix_repetition(pod, WORKLOAD)
    msg = str(err.value)
    if err.type is MisplacedDispatch:
        assert "dispatched outside the connector's dispatching hooks at step" in msg and ">>" in msg, msg
    else:
        assert err.type is DigestMismatch and "dispatch digests diverge at step" in msg, msg


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_worker_fails_fast(make_slice):
    pod = make_slice(_spec(2, 1, num_blocks=48))
    victim = pod.procs[1]
    killed_at = []

    def kill(pod):
        if pod.steps == 6 and not killed_at:
            os.kill(victim.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    with pytest.raises(SliceError) as err:
        run_prefix_repetition(pod, WORKLOAD, on_step=kill)
    assert killed_at
    assert time.monotonic() - killed_at[0] < 10, "a dead host must fail the run within seconds"
    assert "host 1 died" in str(err.value) and "SIGKILL" in str(err.value)
    pod.close()
    assert_gone(pod.procs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hung_worker_times_out(make_slice):
    """A host that stops answering (SIGSTOP: alive, silent) fails the step after step_timeout_s,
    and the SliceError quotes the hung host's log."""
    pod = make_slice(_spec(2, 1, num_blocks=48))
    pod.spec.step_timeout_s = 4.0
    for _ in range(3):
        pod.step()
    os.kill(pod.procs[0].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(SliceError) as err:
        pod.step()
    assert time.monotonic() - t0 < 15
    msg = str(err.value)
    assert "did not answer" in msg and "[0]" in msg
    assert pod.log_path(0) in msg
    pod.close()  # SIGKILL works on a stopped process group
    assert_gone(pod.procs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_worker_start_failure_leaves_nothing(tmp_path, monkeypatch):
    """A host that fails while starting fails the constructor with its traceback, and the
    constructor itself kills every worker (there is no PodSlice to close)."""
    started = []
    real_start = PodSlice._start

    def spy(self):
        try:
            real_start(self)
        finally:
            started.extend(self.procs)

    monkeypatch.setattr(PodSlice, "_start", spy)
    with pytest.raises(SliceError) as err:
        PodSlice(_spec(2, 1, num_blocks=48), Chaos(broken="no-such-bug"), log_dir=str(tmp_path))
    assert "unknown broken variant" in str(err.value)
    assert_gone(started)


def test_misplaced_dispatch_detector():
    """Ops may only be recorded inside the hooks that dispatch (pure function; no processes)."""
    good = ["> bind_connector_metadata", "step n=3", "save", "load", "< bind_connector_metadata", "> forward",
            "< forward", "> start_load_kv", "< start_load_kv", "> wait_for_save", "save",
            "< wait_for_save", "> get_finished", "< get_finished", "> clear_connector_metadata"]
    assert misplaced_op(good) is None
    assert misplaced_op(good[:6] + ["save"] + good[6:]) == 6  # during the forward
    assert misplaced_op(["load"] + good) == 0  # between steps
    assert misplaced_op(good[:-1] + ["save", good[-1]]) == len(good) - 1  # after wait_for_save returned
