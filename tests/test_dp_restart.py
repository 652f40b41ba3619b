"""Warm restart under tpu-inference's DPScheduler (issue 36): one checkpoint per host holds every DP
rank's slots (the host's stores are one set of arrays whatever the number of ranks), and at restore
each rank's scheduler half hears of its own rows only, in its own numbering
(worker/persistence.py: ``split_rows``, ``RankPersistence``); a restored chunk's save id is placed
in its rank's range of ids, so its rank's loads (and other ranks' cross-rank loads) accept it.

What these tests prove, on tpu-inference's own DP cache layouts:

* the workers (one host holding both batch shards of DP 2 x TP 4): both ranks save a chunk into the
  same local slot under the same local save id, the host checkpoints at shutdown, a new host
  restores, each rank's part reports its own row (its own hash keys) and each rank loads its own
  bytes back. Negative controls, each removing one mechanism: the rows split to the wrong ranks
  (rank 0 is told it holds rank 1's chunk, whose hash then names rank 0's bytes), and restored save
  ids left outside the rank's range (the rank's loads are refused);
* a reset (DPScheduler resets every rank at once) revokes each rank's own range and its later saves
  commit; negative control: one revocation floor for every rank drops rank 0's later saves;
* a start with another DP size is refused cleanly (cold, every rank told "nothing restored"), with
  a log line naming the mismatch;
* through tpu-inference's own DPScheduler (its forked rank processes, a 2-process pod slice,
  attention DP 4 x TP 2): serve, shut down cleanly, restart; every rank adopts its own restored
  chunks and the second run's prefixes load from the restored host RAM on every rank, own and
  cross-rank, every context position read exact on every host (the synthetic runner's audit),
  identical dispatch digests, nothing leaked.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dp_helpers import dp_worker, serve_groups, rank_plan as _plan, run_step as _step
from tpuoffload import counters as C
from tpuoffload.messages import RESTORED_BASE, RESTORED_ROW, LoadRequest, SaveBatch, pack_keys
from tpuoffload.worker import persistence

KEYS = [pack_keys(np.array([0x1111 + r], np.uint64), np.array([0x2222 + r], np.uint64)) for r in range(2)]


def _worker(tmp_path, seed: int, layout: str = "bf16-dp2-tp4"):
    """One host holding every batch shard of ``layout``, random contents, warm restart on."""
    return dp_worker({"persist_path": str(tmp_path / "ckpt"), "persist_timeout_s": 30.0}, seed, layout)


def _checkpoint_both_ranks(tmp_path):
    """Both ranks save their local block 3 into local slot 0 under local save id 0 (each with its
    own hash), then the host shuts down (its checkpoint). Returns the saved cache contents."""
    worker, runner, original, per_rank, bpr = _worker(tmp_path, seed=1)
    _step(worker, [_plan(r, bpr, 0, per_rank, save=SaveBatch((3,), (0,), (0,), KEYS[r])) for r in range(2)])
    report = worker.build_report()
    assert {s for r in range(2) for s in report.outcomes(1000 + r)} == {(0, ((0, 1),), ())}
    worker.close()  # the shutdown checkpoint: every rank's slot
    return original, bpr


def _restore_and_load(tmp_path):
    """A new host (other cache contents) restores; returns each rank's reported rows, the failed
    loads of each rank's restored chunk into its local block 9, and the host."""
    worker, runner, _, per_rank, bpr = _worker(tmp_path, seed=2)
    _step(worker, [_plan(r, bpr, 0, per_rank) for r in range(2)])
    report = worker.build_report()
    rows = {r: np.frombuffer(report.tier_parts("persist", 1000 + r)[0].restored, RESTORED_ROW) for r in range(2)}
    loads = [_plan(r, bpr, 1, per_rank, loads=(LoadRequest(f"r{r}", (9,), (0,), (RESTORED_BASE,)),)) for r in range(2)]
    failed = _step(worker, loads)
    return rows, failed, worker, runner


def _own_bytes(runner, original, bpr) -> list[bool]:
    """Whether each rank's local block 9 holds the first run's local block 3 of that rank."""
    return [all(np.array_equal(np.asarray(c)[r * bpr + 9], o[r * bpr + 3]) for c, o in zip(runner.kv_caches, original))
            for r in range(2)]


def _keys_of(rows) -> list[bytes]:
    return [pack_keys(rows["k1"], rows["k2"])]


def test_each_rank_restores_its_own_rows_and_loads_its_own_bytes(tmp_path):
    original, bpr = _checkpoint_both_ranks(tmp_path)
    rows, failed, worker, runner = _restore_and_load(tmp_path)
    for r in range(2):  # its own slot and save id, in its own numbering, under its own hash
        assert rows[r][["slot", "save_id"]].tolist() == [(0, 0)], (r, rows[r])
        assert _keys_of(rows[r]) == [KEYS[r]], r
    assert failed == set()
    assert _own_bytes(runner, original, bpr) == [True, True]
    assert worker.take_stats().reduce()[C.PERSIST_RESTORED_CHUNKS] == 2
    worker.close()


def test_negative_control_rows_split_to_the_wrong_ranks_name_another_ranks_bytes(tmp_path, monkeypatch):
    """The rows handed to the ranks swapped: each rank is told its slot 0 holds the other rank's
    hash, while the slot keeps its own rank's bytes (its tag is right, so the load goes through):
    a lookup of rank 1's prefix on rank 0 would load rank 0's bytes, silently."""
    original, bpr = _checkpoint_both_ranks(tmp_path)
    split = persistence.split_rows
    monkeypatch.setattr(persistence, "split_rows", lambda rows, ranks, per: split(rows, ranks, per)[::-1])
    rows, failed, worker, runner = _restore_and_load(tmp_path)
    assert [_keys_of(rows[r]) for r in range(2)] == [[KEYS[1]], [KEYS[0]]]  # the wrong hashes ...
    assert failed == set() and _own_bytes(runner, original, bpr) == [True, True]  # ... for these bytes
    worker.close()


def test_negative_control_restored_ids_outside_the_ranks_range_are_refused(tmp_path, monkeypatch):
    """Restored save ids not placed in the rank's range (the rank offset left out): rank 1's plan
    names its chunk ``RESTORED_BASE`` in its own numbering, the slot's tag does not match, and its
    load fails (rank 0's offset is 0: it still loads)."""
    original, bpr = _checkpoint_both_ranks(tmp_path)
    monkeypatch.setattr(persistence, "RANK_SAVE_ID_SHIFT", 0)
    _, failed, worker, runner = _restore_and_load(tmp_path)
    assert failed == {"r1"}
    assert _own_bytes(runner, original, bpr)[0]
    worker.close()


def test_a_start_with_another_dp_size_is_refused_and_starts_cold(tmp_path, caplog):
    """DP 2 x TP 4 checkpointed; a start with attention DP 4 x TP 2 on the same devices (another
    split of every chunk) is refused by the fingerprint, naming the DP size, and every rank's part
    reports that nothing was restored."""
    _checkpoint_both_ranks(tmp_path)
    with caplog.at_level(logging.INFO, logger="tpuoffload.worker.persistence"):
        worker, runner, _, per_rank, bpr = _worker(tmp_path, seed=2, layout="bf16-attndp4-tp2")
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "starting cold" in log and "dp_ranks: checkpoint 2, this deployment 4" in log, log
    per_rank, bpr = worker.engine.num_slots(0) // 4, runner.kv_caches[0].shape[0] // 4
    _step(worker, [_plan(r, bpr, 0, per_rank) for r in range(4)])
    report = worker.build_report()
    assert [report.tier_parts("persist", 1000 + r)[0].restored for r in range(4)] == [b""] * 4
    totals = worker.take_stats().reduce()
    assert totals[C.PERSIST_RESTORE_REFUSED] == 1 and totals.get(C.PERSIST_RESTORED_CHUNKS, 0) == 0, totals
    worker.close()


def _reset_then_save(tmp_path) -> tuple[set[str], list[bool]]:
    """Both ranks save local block 3 into local slot 0 (id 0); DPScheduler resets every rank at once:
    each plan revokes its own ids below 1; then each saves local block 3 into local slot 1 (id 1)
    and loads slot 0 (revoked: must fail) and slot 1 into local block 9."""
    from tpuoffload.messages import PersistPlan

    worker, runner, original, per_rank, bpr = _worker(tmp_path, seed=1)
    _step(worker, [_plan(r, bpr, 0, per_rank, save=SaveBatch((3,), (0,), (0,), KEYS[r])) for r in range(2)])
    revoke = {"persist": PersistPlan(revoke_below=1)}
    _step(worker, [_plan(r, bpr, 1, per_rank, tiers=revoke, save=SaveBatch((3,), (1,), (1,), KEYS[r]))
                   for r in range(2)])
    stale = _step(worker, [_plan(r, bpr, 2, per_rank, loads=(LoadRequest(f"old{r}", (8,), (0,), (0,)),))
                           for r in range(2)])
    failed = _step(worker, [_plan(r, bpr, 3, per_rank, loads=(LoadRequest(f"r{r}", (9,), (1,), (1,)),))
                            for r in range(2)])
    assert stale == {"old0", "old1"}  # nothing from before the reset is read again
    own = _own_bytes(runner, original, bpr)
    worker.close()
    return failed, own


def test_a_reset_revokes_each_ranks_own_range_and_its_later_saves_commit(tmp_path):
    failed, own = _reset_then_save(tmp_path)
    assert failed == set() and own == [True, True]


def test_negative_control_one_revocation_floor_for_every_rank_drops_a_ranks_later_saves(tmp_path, monkeypatch):
    """One floor for the whole host (what a single scheduler had): rank 1's reset, in its range of
    ids (1 << 40 and up), puts the floor above every id rank 0 will ever use: rank 0's saves after
    the reset never commit, and its load fails."""
    from tpuoffload.backend.slot_table import SlotTable

    revoke = SlotTable.revoke_below
    monkeypatch.setattr(SlotTable, "revoke_below", lambda self, save_id, shard=None: revoke(self, save_id))
    failed, own = _reset_then_save(tmp_path)
    assert failed == {"r0"} and own == [False, True]


# ---------------------------------------------------------------------------- through DPScheduler
RANKS = 4


def _dp_spec(persist: str):
    from tpuoffload.sim.podslice import SliceSpec

    config = {"num_cpu_chunks": 48 + 16, "persist_path": persist, "persist_timeout_s": 60.0,
              "save_timeout_s": 60.0, "load_wait_timeout_s": 5.0}
    return SliceSpec(num_hosts=2, devices_per_host=4, layout="bf16-attndp4-tp2", num_blocks=96, max_num_seqs=16,
                     max_num_batched_tokens=256, extra_config=config, step_timeout_s=60.0)


def _rank_totals(pod) -> list[dict]:
    from tpuoffload.snapshot import read_rank_snapshots

    snaps = read_rank_snapshots(pod.stats_dir)
    return [snaps[k]["totals"] for k in sorted(snaps)]


def _warm_up(pod, steps: int = 4) -> None:
    """Empty steps: every host's restore report reaches every rank (until then no save is planned:
    a save could take a restored slot), and the ranks' news of what they adopted reaches the
    others' views."""
    for _ in range(steps):
        pod.step()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dpscheduler_restart_loads_every_ranks_restored_host_ram_byte_exact(make_slice, tmp_path):
    """Attention DP 4 x TP 2 over 2 hosts x 4 devices, through tpu-inference's own DPScheduler.
    First run: one 6-block prompt per rank, saved into each rank's share of host RAM; a clean
    shutdown writes one checkpoint per host. Second run: every rank adopts the chunks its own
    part of each host's checkpoint reports; the same prompts, sent so that each lands on the rank
    that saved it, then rotated so that each lands on another rank, load every prefix from the
    restored host RAM (own and cross-rank), every position read exact on every host."""
    from test_podslice import _assert_clean_end

    persist = str(tmp_path / "ckpt")
    rng = np.random.default_rng(36)
    prompts = [rng.integers(3, 30000, 6 * 16 + 5).tolist() for _ in range(RANKS)]

    first = make_slice(_dp_spec(persist))
    assert first.dp_ranks == RANKS and type(first.scheduler).__name__ == "DPScheduler"
    _warm_up(first)  # a cold start: every rank hears "nothing restored" before it saves
    assert serve_groups(first, [prompts], "a") == [list(range(RANKS))]
    saved = [t.get(C.SAVES_ISSUED, 0) for t in _rank_totals(first)]
    assert all(s >= 6 for s in saved), saved
    _assert_clean_end(first)
    per_host = first.shutdown()  # every host writes one checkpoint of every rank's slots
    assert [t[C.PERSIST_SAVED_CHUNKS] for t in per_host] == [sum(saved)] * 2, (per_host, saved)

    second = make_slice(_dp_spec(persist))
    _warm_up(second)
    restored = [t.get(C.RESTORED_READY, 0) for t in _rank_totals(second)]
    assert restored == saved, (restored, saved)  # each rank adopted exactly its own chunks
    # The same prompt on the rank that saved it, then each on the next rank (a cross-rank hit).
    assert serve_groups(second, [prompts], "b") == [list(range(RANKS))]
    assert second.scheduler.reset_prefix_cache()  # HBM forgets (it would route each prompt back)
    rotated = prompts[1:] + prompts[:1]
    assert serve_groups(second, [rotated], "c") == [list(range(RANKS))]
    totals = _rank_totals(second)
    for r, t in enumerate(totals):  # every prefix whole from restored host RAM, twice
        assert t[C.HIT_TOKENS] >= 2 * 6 * 16, (r, t)
        assert t.get(C.CROSS_RANK_HIT_TOKENS, 0) >= 6 * 16, (r, t)
    host = second.stats.totals()
    assert host[C.LOAD_ERRORS] == 0 and host.get(C.CROSS_RANK_LOAD_ERRORS, 0) == 0, host
    assert host[C.PERSIST_RESTORED_CHUNKS] == 2 * sum(saved), host
    _assert_clean_end(second)
