"""Warm restart wired into both halves.

* The manager's side on its own (manager/restart.py, ChunkIndex.adopt): only chunks every host
  restored alike become loadable, in their old recency order; saves wait for the restore and for a
  checkpoint; a checkpoint outcome is matched to the step that planned it; a lost report is
  repeated; a connector reset revokes what the hosts hold.
* One host in process (InProcessEngine, vLLM's real scheduler): stop, start again, the same
  prefixes load from the restored host RAM, byte-exact; after a connector reset nothing from before
  it survives a restart; the engine keeps stepping with no request while a checkpoint or the
  restore reports are due (vLLM's has_pending_push_work), with negative controls.
* The pod slice, N = 2 and 4 processes (jax.distributed): restart byte-exact on every host, chaos on
  the restarted slice, refusals (another host count, a flipped byte) start cold and stay correct.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np
import pytest

from tpuoffload import counters as C
from tpuoffload.messages import (DISK_ROW, RESTORED_BASE, RESTORED_ROW, DiskReport, OffloadWorkerReport,
                                 PersistReport, unpack_keys)
from tpuoffload.persist.request import POLL_INTERVAL_S, read_done, request_checkpoint
from tpuoffload.manager.disk_index import DiskIndex, DiskTierPlanner, FetchPlanner
from tpuoffload.manager.index import READY, ChunkIndex
from tpuoffload.manager.restart import WarmRestart
from tpuoffload.manager.ledger import CompletionLedger
from tpuoffload.manager.save_planner import SavePlanner
from tpuoffload.manager.staging import StagingBudget
from tpuoffload.sim.vllm_setup import make_request


# ---------------------------------------------------------------------------- the scheduler's side
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def rows(*entries: tuple[int, int, int]) -> bytes:
    """RESTORED_ROW rows of (slot, save id, k1) in the KV pool; k2 = k1 + 1."""
    out = np.zeros(len(entries), RESTORED_ROW)
    for i, (slot, save_id, k1) in enumerate(entries):
        out[i] = (slot, save_id, k1, k1 + 1, 0)
    return out.tobytes()


def restart_part(tmp_path, num_hosts=2, num_slots=16, interval=0.0, timeout=30.0):
    counters: Counter[str] = Counter()
    clock = Clock()
    index = ChunkIndex(num_slots, counters=counters)
    return WarmRestart(str(tmp_path), interval, timeout, index, num_hosts, counters, clock), index, counters, clock


def key(k1: int) -> bytes:
    return int(k1).to_bytes(8, "little") + int(k1 + 1).to_bytes(8, "little")


def test_adopts_only_what_every_host_restored_alike(tmp_path):
    part, index, counters, _ = restart_part(tmp_path)
    assert part.saves_blocked  # nothing planned into a restored slot before the hosts reported
    part.on_report({0: PersistReport(restored=rows((1, 10, 100), (2, 11, 200), (3, 12, 300), (4, 5, 400)))})
    assert part.saves_blocked and len(index) == 0  # host 1 has not reported
    # host 1: slot 2 holds another save (not confirmed there when the checkpoint was taken), slot 3 another hash
    part.on_report({1: PersistReport(restored=rows((1, 10, 100), (2, 9, 200), (3, 12, 301), (4, 5, 400)))})
    assert not part.saves_blocked
    assert index.slot_of(key(100)) == 1 and index.slot_of(key(400)) == 4
    assert index.slot_of(key(200)) is None and index.slot_of(key(300)) is None
    assert index.state_of(1) == READY and index.save_id_of(1) == RESTORED_BASE + 1
    assert index.lru_order() == [4, 1]  # oldest save (5) evicted first
    assert counters[C.RESTORED_READY] == 2 and counters[C.RESTORED_DROPPED] == 2
    assert index.num_free_slots == 14
    assert list(index.allocate(16)) and index.slot_of(key(400)) is None  # evictable like any READY chunk


def test_restored_hash_held_twice_or_slot_out_of_range_is_dropped(tmp_path):
    part, index, counters, _ = restart_part(tmp_path, num_hosts=1, num_slots=8)
    part.on_report({0: PersistReport(restored=rows((1, 10, 100), (2, 11, 100), (9, 12, 300), (3, 13, 0)))})
    assert len(index) == 1 and counters[C.RESTORED_READY] == 1 and counters[C.RESTORED_DROPPED] == 3
    assert index.slot_of(key(100)) == 1  # a k1 of 0 (a free table cell's marker) was not inserted


def test_restore_report_that_never_comes_unblocks_saves_after_the_timeout(tmp_path):
    part, index, counters, clock = restart_part(tmp_path, timeout=30.0)
    part.on_report({0: PersistReport(restored=rows((1, 10, 100)))})
    assert not part.plan(0) and part.saves_blocked
    clock.t = 31.0
    part.plan(1)
    assert not part.saves_blocked and len(index) == 0 and counters[C.RESTORED_DROPPED] == 1
    part.on_report({1: PersistReport(restored=rows((1, 10, 100)))})  # too late: ignored
    assert len(index) == 0


def test_operator_request_blocks_saves_until_every_host_reports_that_checkpoint(tmp_path):
    part, _, counters, clock = restart_part(tmp_path)
    part.on_report({0: PersistReport(restored=b""), 1: PersistReport(restored=b"")})
    assert not part.plan(0)
    req = request_checkpoint(str(tmp_path))
    clock.t = 2.0  # the watcher polls once a second
    assert part.plan(1) and part.saves_blocked
    assert not part.plan(2)  # one at a time
    # A repeated outcome of an earlier checkpoint (planned in step 0) is not this one's.
    part.on_report({0: PersistReport(checkpoints=((0, 3, True),)), 1: PersistReport(checkpoints=((1, 4, True),))})
    assert part.saves_blocked
    part.on_report({0: PersistReport(checkpoints=((1, 4, True),))})
    assert not part.saves_blocked
    done = read_done(str(tmp_path))
    assert done is not None and done.id == req.id and done.ok and done.seq == 4
    assert counters[C.CHECKPOINTS_PLANNED] == 1 and counters[C.CHECKPOINTS_COMMITTED] == 1


def test_checkpoint_failed_on_one_host_or_unreported_is_answered_failed(tmp_path):
    part, _, counters, clock = restart_part(tmp_path, interval=10.0, timeout=30.0)
    part.on_report({0: PersistReport(restored=b""), 1: PersistReport(restored=b"")})
    clock.t = 10.0
    assert part.plan(5)
    part.on_report({0: PersistReport(checkpoints=((5, 1, True),)), 1: PersistReport(checkpoints=((5, 1, False),))})
    assert not part.saves_blocked and counters[C.CHECKPOINTS_FAILED] == 1
    clock.t = 20.0
    assert part.plan(9)  # the interval again
    clock.t = 51.0  # host 1 never reports: given up; the next one waits as long as that one took
    assert not part.plan(12)
    assert counters[C.CHECKPOINTS_FAILED] == 2
    clock.t = 82.0
    assert part.plan(13)


def test_the_interval_counts_from_the_end_of_a_checkpoint_and_is_never_shorter_than_one(tmp_path):
    """Saves stop while a checkpoint is written: with the interval counted from the plan, a
    checkpoint slower than the interval would be followed at once by the next, and no save would
    ever run (the serving stack's 10 s interval on a loaded box skipped every save)."""
    part, _, counters, clock = restart_part(tmp_path, interval=10.0, timeout=300.0)
    part.on_report({0: PersistReport(restored=b""), 1: PersistReport(restored=b"")})
    clock.t = 10.0
    assert part.plan(1)
    clock.t = 25.0  # written in 15 s, longer than the interval
    part.on_report({0: PersistReport(checkpoints=((1, 1, True),)), 1: PersistReport(checkpoints=((1, 1, True),))})
    assert not part.saves_blocked
    for t in (25.0, 30.0, 39.9):
        clock.t = t
        assert not part.plan(2), t  # saves get as long as the checkpoint took
    clock.t = 40.0
    assert part.plan(3)
    clock.t = 42.0  # a quick one: the plain interval from its end
    part.on_report({0: PersistReport(checkpoints=((3, 2, True),)), 1: PersistReport(checkpoints=((3, 2, True),))})
    clock.t = 51.9
    assert not part.plan(4)
    clock.t = 52.0
    assert part.plan(5)
    assert counters[C.CHECKPOINTS_COMMITTED] == 2


def test_reset_revokes_on_every_host_and_drops_a_pending_restore(tmp_path):
    part, index, counters, _ = restart_part(tmp_path)
    part.on_report({0: PersistReport(restored=rows((1, 10, 100)))})
    part.on_reset(next_save_id=77)
    assert part.take_revoke() == 77 and part.take_revoke() is None
    part.on_report({1: PersistReport(restored=rows((1, 10, 100)))})
    assert len(index) == 0 and not part.saves_blocked


def disk_rows(*entries: tuple[int, int]) -> bytes:
    """DISK_ROW rows of (disk id, k1); k2 = k1 + 1; the KV pool's files (pool 0)."""
    out = np.zeros(len(entries), DISK_ROW)
    for i, (disk_id, k1) in enumerate(entries):
        out[i] = (disk_id, k1, k1 + 1, 0)
    return out.tobytes()


def disk_part():
    """The disk tier's manager side over 4 disk chunks, 2 hosts, warm restart on."""
    counters: Counter[str] = Counter()
    clock = Clock()
    disk = DiskIndex(4, 2, counters, clock, 30.0)
    ram = ChunkIndex(16, counters=counters)
    saves = SavePlanner(ram, CompletionLedger(2), StagingBudget(16), chunk_bytes=1, save_timeout_s=30.0, clock=clock,
                        counters=counters)
    fetches = FetchPlanner(saves, disk, 16, counters, lambda rid: None)
    return DiskTierPlanner(disk, fetches, ram, 2, counters, clock, 30.0, keeps_files=True), disk, counters, clock


def test_disk_files_every_host_kept_alike_are_indexed_again_and_the_rest_deleted(tmp_path):
    part, disk, counters, _ = disk_part()
    assert part.blocks_saves  # no spill may take a kept file's disk id before the hosts reported
    # least recently used first; host 1 lost 200's file and holds 300 under another disk id
    part.on_report({0: DiskReport(kept=disk_rows((7, 100), (3, 200), (9, 300), (4, 500), (8, 1)))})
    assert len(disk.index) == 0 and part.blocks_saves  # host 1 has not reported
    part.on_report({1: DiskReport(kept=disk_rows((4, 500), (7, 100), (5, 300), (6, 400), (8, 1)))})
    assert not part.blocks_saves
    assert [disk.index.slot_of(key(k)) is not None for k in (100, 200, 300, 400, 500)] == [True, False, False,
                                                                                          False, True]
    # fetchable, under the disk id each file was written with, in host 0's recency order
    entries = [disk.index.slot_of(key(k)) for k in (100, 500)]
    assert disk.index.ready_prefix([key(100), key(500), key(300)]) == entries
    assert list(disk.index.save_ids(np.array(entries))) == [7, 4] and disk.index.lru_order() == entries
    # deleted on every host; k1 = 1 (a free table cell's marker, never a scheduler's key) too
    assert sorted(unpack_keys(disk.take_drops().keys)[:, 0]) == [1, 200, 300, 400]
    assert counters[C.DISK_RESTORED_READY] == 2 and counters[C.DISK_RESTORED_DROPPED] == 4


def test_a_host_that_holds_no_byte_of_the_files_has_no_say_on_them(tmp_path):
    """Under DPScheduler a rank whose batch shard has no device on host 1 keeps its files on host 0
    only (host 1's disk tier for it is NoChunkFiles): host 1 reports no file and says it is blind
    to that pool, so host 0's files are adopted. The two files host 0 no longer has are not."""
    part, disk, counters, _ = disk_part()
    part.on_report({0: DiskReport(kept=disk_rows((7, 100), (3, 200), (9, 300)))})
    part.on_report({1: DiskReport(kept=b"", blind=(0,))})
    assert not part.blocks_saves
    assert [disk.index.slot_of(key(k)) is not None for k in (100, 200, 300)] == [True, True, True]
    assert counters[C.DISK_RESTORED_READY] == 3 and counters[C.DISK_RESTORED_DROPPED] == 0
    # Negative control: the same host not saying it is blind counts as keeping nothing: all dropped.
    part, disk, counters, _ = disk_part()
    part.on_report({0: DiskReport(kept=disk_rows((7, 100), (3, 200), (9, 300)))})
    part.on_report({1: DiskReport(kept=b"")})
    assert len(disk.index) == 0 and counters[C.DISK_RESTORED_DROPPED] == 3
    # A blind report merged with a later one keeps its blindness (vLLM's aggregator merges reports).
    merged = DiskReport(kept=b"", blind=(0,)).merge(DiskReport(saved=((0, 2),)))
    assert merged.blind == (0,) and merged.kept == b"" and merged.saved == ((0, 2),)


def test_disk_files_kept_are_never_adopted_after_the_timeout_or_a_reset(tmp_path):
    for how in ("timeout", "reset"):
        part, disk, counters, clock = disk_part()
        part.on_report({0: DiskReport(kept=disk_rows((7, 100)))})
        if how == "timeout":
            clock.t = 31.0
            part.start_step(0)
        else:
            part.reset(next_save_id=0)
            assert part.finish_step(0).delete_all  # every host deletes every file
        assert not part.blocks_saves
        part.on_report({1: DiskReport(kept=disk_rows((7, 100)))})  # too late
        assert len(disk.index) == 0 and counters[C.DISK_RESTORED_READY] == 0, how


def test_a_report_of_restored_rows_only_survives_vllms_aggregator():
    """vLLM's KVOutputAggregator drops falsy worker metadata; a report with no save outcome but
    restored rows (len 0) must still arrive."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    agg = KVOutputAggregator(expected_finished_count=2)
    outs = []
    for host in range(2):
        out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=OffloadWorkerReport(
            tiers={"persist": {(0, host): PersistReport(restored=rows((host, 1, 5)))}}))
        outs.append(out)
    merged = agg.aggregate(outs, output_rank=0).kv_connector_output.kv_connector_worker_meta
    assert isinstance(merged, OffloadWorkerReport) and sorted(merged.tier_parts("persist", 0)) == [0, 1]


# ---------------------------------------------------------------------------- one host, in process
def _engine(persist: str, **extra):
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine

    config = {"cpu_bytes_to_use": 1 << 22, "persist_path": persist, **extra}
    return InProcessEngine(EngineSpec(num_hosts=1, num_blocks=64, extra_config=config))


def _wave(tag: str, n: int = 8):
    from tpuoffload.sim.workload import prefix_repetition

    return prefix_repetition(n, 2, 96, 24, 4, seed=3, id_prefix=tag, block_size=16)


def _run(engine, requests) -> None:
    for r in requests:
        engine.add_request(r)
    engine.run()
    engine.settle()


def test_restart_in_process_loads_restored_prefixes_byte_exact(tmp_path):
    persist = str(tmp_path / "ckpt")
    first = _engine(persist)
    _run(first, _wave("a"))
    saved = first.stats.totals()[C.CHUNKS_SAVED]
    assert saved > 0 and first.mismatches() == 0
    first.close()  # clean shutdown: the host writes its checkpoint
    assert sorted(os.listdir(persist))[0] == "ckpt-1"

    second = _engine(persist)
    _run(second, _wave("b"))  # the same prefixes, other suffixes
    totals = second.stats.totals()
    assert totals[C.PERSIST_RESTORED_CHUNKS] == saved
    assert totals[C.RESTORED_READY] == saved
    assert totals[C.HIT_TOKENS] > 0 and totals[C.CHUNKS_LOADED] > 0 and totals[C.LOAD_ERRORS] == 0
    assert second.mismatches() == 0 and second.runners[0].stats.positions_verified > 0
    second.close()


def test_restart_after_a_connector_reset_restores_nothing_from_before_it(tmp_path):
    """After vLLM's reset_prefix_cache(reset_connector=True) (a weight update), KV saved before it
    must not come back through a checkpoint either (the hosts forget it: revoke_below)."""
    persist = str(tmp_path / "ckpt")
    first = _engine(persist)
    _run(first, _wave("a"))
    assert first.stats.totals()[C.CHUNKS_SAVED] > 0
    assert first.scheduler.reset_prefix_cache(reset_connector=True)
    first.settle()  # an empty step carries revoke_below to the host
    first.close()
    second = _engine(persist)
    _run(second, _wave("b"))
    totals = second.stats.totals()
    assert totals[C.PERSIST_RESTORED_CHUNKS] == 0 and totals[C.RESTORED_READY] == 0
    assert totals[C.HIT_TOKENS] == 0 and second.mismatches() == 0
    second.close()


def test_lost_restore_report_is_repeated_until_the_scheduler_has_it(tmp_path):
    persist = str(tmp_path / "ckpt")
    first = _engine(persist)
    _run(first, _wave("a"))
    first.close()
    second = _engine(persist)
    reports = iter(range(1 << 30))
    second.drop_report = lambda step, host: next(reports) < 2  # the first two reports are lost on the way
    second.settle()  # three empty steps: the rows come again with the third
    assert second.offload.tier("persist").blocks_saves is False
    _run(second, _wave("b"))
    totals = second.stats.totals()
    assert totals[C.RESTORED_READY] > 0 and totals[C.HIT_TOKENS] > 0 and second.mismatches() == 0
    second.close()


def test_operator_request_in_process_writes_a_checkpoint_and_answers(tmp_path):
    persist = str(tmp_path / "ckpt")
    engine = _engine(persist)
    _run(engine, _wave("a"))
    req = request_checkpoint(persist)
    deadline = time.monotonic() + 60
    while read_done(persist) is None and time.monotonic() < deadline:
        engine.settle()
        time.sleep(0.2)
    done = read_done(persist)
    assert done is not None and done.id == req.id and done.ok, done
    assert engine.stats.totals()[C.CHECKPOINTS_COMMITTED] == 1
    assert os.path.isdir(os.path.join(persist, f"ckpt-{done.seq}"))
    engine.close()


def _no_keepalive(monkeypatch) -> None:
    """Negative control: the one mechanism off (the tier never asks vLLM to keep stepping)."""
    monkeypatch.setattr(WarmRestart, "keeps_engine_stepping", property(lambda self: False))


@pytest.mark.parametrize("keepalive", [True, False], ids=["keepalive", "control"])
def test_a_checkpoint_asked_as_traffic_ends_is_answered_without_more_traffic(tmp_path, monkeypatch, keepalive):
    """The operator asks, one last request (one token: done in its first step) plans the checkpoint,
    then no request comes. vLLM's own Scheduler.has_requests asks the connector's
    has_pending_push_work, so the engine steps (scheduling nothing) until every host reported the
    checkpoint; the control stops with the request and never answers."""
    if not keepalive:
        _no_keepalive(monkeypatch)
    persist = str(tmp_path / "ckpt")
    engine = _engine(persist)
    _run(engine, _wave("a"))
    req = request_checkpoint(persist)
    time.sleep(POLL_INTERVAL_S)  # the request file is read at the next step
    last = make_request("last", list(range(100, 140)), max_tokens=1, block_size=16)
    engine.add_request(last)
    steps = engine.run()
    totals = engine.stats.totals()
    assert totals[C.CHECKPOINTS_PLANNED] == 1  # both ways: the last request's step planned it
    done = read_done(persist)
    if keepalive:
        assert steps > 1 and done is not None and done.id == req.id and done.ok, (steps, done)
        assert os.path.isdir(os.path.join(persist, f"ckpt-{done.seq}"))
        assert not engine.has_work()  # and then it idles
    else:
        assert done is None and totals[C.CHECKPOINTS_COMMITTED] == 0, (steps, done)
    engine.close()


@pytest.mark.parametrize("keepalive", [True, False], ids=["keepalive", "control"])
def test_restored_chunks_are_loadable_for_the_first_request(tmp_path, monkeypatch, keepalive):
    """A restarted engine steps before any request until every host reported what it restored
    (has_pending_push_work), so the first request after a restart already loads restored KV; the
    control's first request finds nothing (the restore is adopted in its own first step)."""
    if not keepalive:
        _no_keepalive(monkeypatch)
    persist = str(tmp_path / "ckpt")
    first = _engine(persist)
    _run(first, _wave("a"))
    saved = first.stats.totals()[C.CHUNKS_SAVED]
    first.close()
    second = _engine(persist)
    idle_steps = second.run()  # no request yet: what the engine does while it waits for traffic
    assert second.stats.totals()[C.RESTORED_READY] == (saved if keepalive else 0), idle_steps
    _run(second, _wave("b", n=1))
    totals = second.stats.totals()
    assert second.mismatches() == 0
    if keepalive:
        assert idle_steps >= 1 and totals[C.HIT_TOKENS] > 0 and totals[C.CHUNKS_LOADED] > 0
    else:
        assert idle_steps == 0 and totals[C.HIT_TOKENS] == 0 and totals[C.RESTORED_READY] == saved
    second.close()


# ---------------------------------------------------------------------------- the pod slice


def _slice_spec(num_hosts: int, devices_per_host: int, persist: str):
    from tpuoffload.sim.podslice import SliceSpec

    config = {"cpu_bytes_to_use": 1 << 22, "save_timeout_s": 5.0, "load_wait_timeout_s": 2.0,
              "persist_path": persist, "persist_timeout_s": 60.0}
    return SliceSpec(num_hosts=num_hosts, devices_per_host=devices_per_host, num_kv_heads=8, num_blocks=48,
                     max_num_seqs=16, max_num_batched_tokens=256, extra_config=config, step_timeout_s=90.0)


def _workload():
    from tpuoffload.sim.workload import PrefixRepetition

    return PrefixRepetition(num_prefixes=4, prefix_blocks=10, suffix_len=(8, 16), output_len=(4, 8),
                            num_requests=16, waves=1, arrivals_per_step=4, seed=5)


def _serve(pod):
    """One wave of the workload: (loaded chunks, the result), checked byte-exact on every host."""
    from tpuoffload.sim.workload import run_prefix_repetition

    res = run_prefix_repetition(pod, _workload())
    assert res.wrong_outputs == [] and res.finished + res.aborted == res.requests, res
    states = pod.worker_state()
    assert all(s["mismatches"] == 0 and s["positions_verified"] > 0 for s in states), states
    assert all(len(set(step)) == 1 for step in pod.digests)  # every host dispatched the same, every step
    return res.per_wave_loaded[0], res


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("num_hosts,devices_per_host", [(4, 1)])  # 2 hosts: the chaos, corrupt and killed restarts
def test_podslice_restart_hits_restored_host_ram_byte_exact(make_slice, tmp_path, num_hosts, devices_per_host):
    persist = str(tmp_path / "ckpt")
    spec = _slice_spec(num_hosts, devices_per_host, persist)
    # Every save must resolve as confirmed, never expire, for the checkpoint to hold exactly what the
    # hosts saved: a generous timeout keeps a busy machine's slow steps (4 processes on 2 cores, with
    # another test file beside them) from expiring saves. Expiry under chaos: test_podslice_restart_under_chaos.
    spec.extra_config["save_timeout_s"] = 60.0
    first = make_slice(spec)
    cold_loaded, _ = _serve(first)
    saved = first.stats.totals()[C.CHUNKS_SAVED]
    per_host = first.shutdown()  # every host writes its part; orbax commits once all have
    assert all(t[C.PERSIST_SAVED_CHUNKS] == saved // num_hosts for t in per_host), per_host
    assert os.path.isdir(os.path.join(persist, "ckpt-1"))

    second = make_slice(spec)
    warm_loaded, res = _serve(second)
    totals = second.stats.totals()
    assert totals[C.PERSIST_RESTORED_CHUNKS] == saved and totals[C.RESTORED_READY] == saved // num_hosts
    assert totals[C.LOAD_ERRORS] == 0
    # The first wave after the restart loads what the cold first wave had to compute.
    assert warm_loaded > cold_loaded, (warm_loaded, cold_loaded)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_podslice_restart_under_chaos(make_slice, tmp_path):
    """The restarted slice runs a storm: slow and failing hosts, lost and doubled reports (the
    restore rows are repeated until the scheduler has every host's), aborts, preemptions."""
    from tpuoffload.sim.chaos import Chaos

    persist = str(tmp_path / "ckpt")
    spec = _slice_spec(2, 2, persist)
    first = make_slice(spec)
    _serve(first)
    first.shutdown()
    second = make_slice(spec, Chaos.storm(2, seed=11))
    _, res = _serve(second)
    totals = second.stats.totals()
    assert totals[C.RESTORED_READY] > 0 and totals[C.CHUNKS_LOADED] > 0, totals


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_podslice_refuses_a_corrupt_or_foreign_checkpoint_and_starts_cold(make_slice, tmp_path):
    persist = str(tmp_path / "ckpt")
    first = make_slice(_slice_spec(2, 2, persist))
    _serve(first)
    first.shutdown()
    # Another host count over the same devices: refused by the fingerprint, cold, correct.
    other = make_slice(_slice_spec(4, 1, persist))
    _serve(other)
    totals = other.stats.totals()
    assert totals[C.PERSIST_RESTORE_REFUSED] == 4 and totals[C.RESTORED_READY] == 0
    other.close()  # no shutdown: its own checkpoint must not replace the first one
    # A flipped byte in the largest slot data file: refused on every host (checksums), cold, correct.
    data = max((os.path.join(d, f) for d, _, fs in os.walk(os.path.join(persist, "ckpt-1", "slots")) for f in fs),
               key=os.path.getsize)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    again = make_slice(_slice_spec(2, 2, persist))
    _serve(again)
    totals = again.stats.totals()
    assert totals[C.PERSIST_RESTORE_REFUSED] == 2 and totals[C.RESTORED_READY] == 0, totals
    with open(again.log_path(0)) as f:
        log = f.read()
    assert "starting cold" in log and ("checksum" in log or "unreadable slots" in log), log[-2000:]


def test_cli_checkpoint_command_asks_and_reports_no_answer(tmp_path, capsys):
    from tpuoffload.cli import main
    from tpuoffload.persist.request import REQUEST_NAME

    assert main(["checkpoint", str(tmp_path)]) == 0
    assert os.path.exists(os.path.join(tmp_path, REQUEST_NAME))
    assert main(["checkpoint", str(tmp_path), "--wait", "0.3"]) == 2  # no engine answers
    assert "no answer" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_podslice_host_killed_during_a_checkpoint_next_start_is_cold_and_correct(make_slice, tmp_path):
    from tpuoffload.persist.request import request_checkpoint
    from tpuoffload.sim.podslice import SliceError
    from tpuoffload.sim.chaos import Chaos

    persist = str(tmp_path / "ckpt")
    spec = _slice_spec(2, 2, persist)
    spec.extra_config["persist_timeout_s"] = 10.0  # the surviving host gives up on the dead one
    first = make_slice(spec, Chaos(die_in_checkpoint_host=1))
    _serve(first)
    request_checkpoint(persist)
    time.sleep(1.2)  # the scheduler polls the request file once a second
    with pytest.raises(SliceError, match="host 1 died"):
        for _ in range(20):
            first.step()
    first.close()
    assert not any(n.startswith("ckpt-") and "tmp" not in n for n in os.listdir(persist)), os.listdir(persist)
    second = make_slice(spec)
    _serve(second)
    totals = second.stats.totals()
    assert totals[C.PERSIST_RESTORE_REFUSED] == 2 and totals[C.RESTORED_READY] == 0, totals
