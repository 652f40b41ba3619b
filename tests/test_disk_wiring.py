"""The disk tier wired into both halves (issue 10, part 2), on vLLM's real scheduler.

Host RAM holds a few chunks; the disk far more. Chunks evicted from host RAM spill to every host's
disk; a prefix that continues on disk comes back into host RAM (the request waits for it) and is
loaded like any other, byte-exact. A corrupted or missing file on one host fails the fetch on every
host alike (vLLM recomputes; no retry loop), and the disk budget is never exceeded. With warm
restart the chunk files survive a restart: those every host kept alike are fetched again.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import time

import pytest
from conftest import assert_engine_clean

from tpuoffload import counters as C
from tpuoffload.manager.disk_index import DiskIndex

RAM_CHUNKS = 12
DISK_BYTES = 40 * (4096 + 65536)  # 40 chunk files of the sim layout's 64 KiB chunks


def _engine(tmp_path, num_hosts=1, **extra):
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine

    config = {"num_cpu_chunks": RAM_CHUNKS, "disk_path": str(tmp_path / "disk-{host}"),
              "disk_bytes_to_use": DISK_BYTES, **extra}
    return InProcessEngine(EngineSpec(num_hosts=num_hosts, num_blocks=64, extra_config=config))


def _wave(tag: str):
    from tpuoffload.sim.workload import prefix_repetition

    return prefix_repetition(8, 4, 96, 24, 4, seed=3, id_prefix=tag, block_size=16)


def _files(tmp_path) -> dict[str, int]:
    return {d: len(glob.glob(os.path.join(d, "*.kv"))) for d in glob.glob(str(tmp_path / "disk-*"))}


def _run(engine, requests, tmp_path, capacity: int) -> None:
    def check_budget(eng):
        for d, n in _files(tmp_path).items():
            assert n <= capacity, (d, n, capacity)

    for r in requests:
        engine.add_request(r)
    engine.run(on_step=check_budget)
    engine.settle()
    check_budget(engine)


def _until_restored(engine, timeout: float = 60.0) -> None:
    """Empty steps until every tier took the hosts' restore reports (host RAM restored, kept disk
    files adopted). The reports come from the workers' background threads: a request admitted
    before they arrive misses what is being restored, which is correct but not what these tests
    look at."""
    deadline = time.monotonic() + timeout
    while any(t.blocks_saves for t in engine.offload.tiers):
        assert time.monotonic() < deadline, "the hosts' restore reports never arrived"
        engine.settle()


@pytest.mark.parametrize("num_hosts", [1, 2])
def test_prefixes_come_back_from_disk_byte_exact(tmp_path, num_hosts):
    engine = _engine(tmp_path, num_hosts)
    capacity = DiskIndex.capacity(DISK_BYTES, engine.offload.chunk_bytes)
    _run(engine, _wave("a"), tmp_path, capacity)
    totals = engine.stats.totals()
    assert totals[C.SPILLS_CONFIRMED] > 0 and totals[C.DISK_WRITTEN_CHUNKS] == num_hosts * totals[C.SPILLS_CONFIRMED]
    assert engine.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets: host RAM and disk remain
    _run(engine, _wave("b"), tmp_path, capacity)
    totals = engine.stats.totals()
    assert totals[C.FETCHES_ISSUED] > 0 and totals[C.FETCHES_FAILED] == 0
    assert totals[C.DISK_READ_CHUNKS] == num_hosts * totals[C.FETCHES_ISSUED]
    assert totals[C.HIT_TOKENS] > 0 and totals[C.LOAD_ERRORS] == 0
    assert_engine_clean(engine)
    engine.close()


def test_a_prefix_split_between_disk_and_host_ram_comes_back_whole(tmp_path):
    """A's first 4 blocks went to disk, its other 8 stay in host RAM as the least recently used
    chunks. Asked again, A waits for its 4 blocks from disk and loads all 12: the fetch's own slots
    must not evict the host-RAM part of the hit it completes (pinned until the fetch resolves)."""
    import random

    from tpuoffload.sim.vllm_setup import make_request

    engine = _engine(tmp_path, num_cpu_chunks=24)
    rng = random.Random(7)
    a, b = ([rng.randrange(10, 30000) for _ in range(n * 16 + 5)] for n in (12, 16))
    capacity = DiskIndex.capacity(DISK_BYTES, engine.offload.chunk_bytes)
    for rid, tokens in (("a", a), ("b", b)):  # 28 chunks into 24 slots: A's first 4 spill
        _run(engine, [make_request(rid, tokens, max_tokens=2, block_size=16)], tmp_path, capacity)
    assert engine.stats.totals()[C.SPILLS_CONFIRMED] == 4
    assert engine.scheduler.reset_prefix_cache()
    _run(engine, [make_request("a2", a, max_tokens=2, block_size=16)], tmp_path, capacity)
    totals = engine.stats.totals()
    assert totals[C.FETCHES_ISSUED] == 4 and totals[C.FETCHES_FAILED] == 0, totals
    assert totals[C.HIT_TOKENS] == 12 * 16, totals
    assert_engine_clean(engine)
    engine.close()


@pytest.mark.parametrize("where", ["every host", "host 1 only"])
def test_corrupt_chunk_files_fail_the_fetch_everywhere_and_are_recomputed(tmp_path, where):
    engine = _engine(tmp_path, 2)
    capacity = DiskIndex.capacity(DISK_BYTES, engine.offload.chunk_bytes)
    _run(engine, _wave("a"), tmp_path, capacity)
    dirs = sorted(_files(tmp_path))
    for d in dirs if where == "every host" else dirs[1:]:
        for path in glob.glob(os.path.join(d, "*.kv")):
            with open(path, "r+b") as f:  # one flipped bit in the payload (after the 4 KiB header)
                f.seek(4096 + 1000)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 1]))
    assert engine.scheduler.reset_prefix_cache()
    _run(engine, _wave("b"), tmp_path, capacity)
    totals = engine.stats.totals()
    assert totals[C.FETCHES_ISSUED] > 0
    assert totals[C.FETCHES_FAILED] == totals[C.FETCHES_ISSUED]  # each fetched once, failed, forgotten
    assert totals[C.DISK_READ_FAILED] > 0
    assert totals[C.LOAD_ERRORS] == 0  # a failed fetch never became loadable, so nothing loads garbage
    assert_engine_clean(engine)
    engine.close()


def test_disk_tier_and_warm_restart_together(tmp_path):
    """A restart keeps host RAM (checkpoint) and the disk tier's chunk files (written under the same
    deployment): the same prompts come back from both, byte-exact. A start without warm restart
    keeps no file: it could not tell which deployment wrote them."""
    persist = str(tmp_path / "ckpt")
    first = _engine(tmp_path, persist_path=persist)
    capacity = DiskIndex.capacity(DISK_BYTES, first.offload.chunk_bytes)
    for wave in ("a", "b"):  # the first start skips saves until it has the restore reports
        _run(first, _wave(wave), tmp_path, capacity)
        assert first.scheduler.reset_prefix_cache()
    assert first.stats.totals()[C.SPILLS_CONFIRMED] > 0
    first.close()
    on_disk = sum(_files(tmp_path).values())
    second = _engine(tmp_path, persist_path=persist)
    _until_restored(second)
    _run(second, _wave("c"), tmp_path, capacity)  # the same prompts
    totals = second.stats.totals()
    assert totals[C.RESTORED_READY] > 0 and totals[C.DISK_RESTORED_READY] == on_disk > 0, totals
    assert totals[C.FETCHES_ISSUED] > 0 and totals[C.FETCHES_FAILED] == 0, totals
    assert totals[C.HIT_TOKENS] > 0 and totals[C.LOAD_ERRORS] == 0 and totals[C.SPILLS_CONFIRMED] > 0, totals
    assert_engine_clean(second)
    second.close()
    assert sum(_files(tmp_path).values()) > 0
    third = _engine(tmp_path)
    assert sum(_files(tmp_path).values()) == 0
    third.close()


def test_reset_deletes_files_kept_from_a_restore_that_was_given_up(tmp_path):
    """Files kept at start-up whose restore the scheduler gave up on (a host's report never came)
    are not indexed; a later connector reset (a weight update) must delete them too, or a later
    spill of the same hash under a coincident disk id would be taken as already written."""
    persist = str(tmp_path / "ckpt")
    first = _engine(tmp_path, persist_path=persist)
    capacity = DiskIndex.capacity(DISK_BYTES, first.offload.chunk_bytes)
    for wave in ("a", "b"):
        _run(first, _wave(wave), tmp_path, capacity)
        assert first.scheduler.reset_prefix_cache()
    first.close()
    assert sum(_files(tmp_path).values()) > 0
    second = _engine(tmp_path, persist_path=persist, persist_timeout_s=0.5)
    second.drop_report = lambda step, host: True  # the restore report never arrives ...
    time.sleep(0.6)
    second.settle()  # ... and is given up
    second.drop_report = None
    assert not second.offload.tier("persist").blocks_saves and second.stats.totals()[C.DISK_RESTORED_READY] == 0
    assert sum(_files(tmp_path).values()) > 0  # kept by the tier, unknown to the scheduler
    assert second.scheduler.reset_prefix_cache(reset_connector=True)
    second.settle()
    deadline = time.monotonic() + 10  # files are unlinked on the tier's threads
    while sum(_files(tmp_path).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(_files(tmp_path).values()) == 0
    second.close()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_podslice_disk_tier_under_chaos(make_slice, tmp_path):
    """Two JAX processes, host RAM of 12 chunks, the disk tier below it, and a storm: a slow disk on
    host 0, failed disk writes and reads on host 1, slow and failing saves, lost and doubled
    reports, aborts. Byte-exact on every host, identical dispatch digests at every step, the disk
    budget never exceeded."""
    from tpuoffload.sim.podslice import SliceSpec
    from tpuoffload.sim.chaos import Chaos
    from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

    config = {"num_cpu_chunks": RAM_CHUNKS, "disk_path": str(tmp_path / "disk-{host}"), "disk_bytes_to_use": DISK_BYTES,
              "save_timeout_s": 5.0, "load_wait_timeout_s": 2.0}
    spec = SliceSpec(num_hosts=2, devices_per_host=2, num_kv_heads=8, num_blocks=48, max_num_seqs=16,
                     max_num_batched_tokens=256, extra_config=config, step_timeout_s=90.0)
    workload = PrefixRepetition(num_prefixes=4, prefix_blocks=8, suffix_len=(8, 16), output_len=(4, 8),
                                num_requests=24, waves=3, arrivals_per_step=4, seed=2)
    # The storm, with one disk failure in ten on host 1 (a chunk spills only if every host wrote it).
    chaos = dataclasses.replace(Chaos.storm(2, seed=4), fail_disk_rate=0.1)
    pod = make_slice(spec, chaos)
    capacity = DiskIndex.capacity(DISK_BYTES, pod.offload.chunk_bytes)

    def check_budget(p):
        for d, n in _files(tmp_path).items():
            assert n <= capacity, (d, n, capacity)

    res = run_prefix_repetition(pod, workload, on_step=check_budget)
    assert res.wrong_outputs == [] and res.finished + res.aborted == res.requests, res
    states = pod.worker_state()
    assert all(s["mismatches"] == 0 and s["positions_verified"] > 0 for s in states), states
    assert all(len(set(step)) == 1 for step in pod.digests)
    totals = pod.stats.totals()
    assert totals[C.SPILLS_CONFIRMED] > 0 and totals[C.SPILLS_DROPPED] > 0, totals  # host 1's failed writes
    assert totals[C.FETCHES_ISSUED] > 0, totals
    assert totals[C.DISK_WRITE_FAILED] + totals[C.DISK_READ_FAILED] > 0, totals


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_podslice_restart_indexes_the_files_every_host_kept(make_slice, tmp_path):
    """Two JAX processes with host RAM, the disk tier and warm restart. Between the two starts one
    chunk file disappears from host 1's disk: after the restart the chunks on both disks come back
    into host RAM (every host reads them, checksums and save ids checked) and outputs stay
    byte-exact on every host, the lost one is not fetched anywhere (no fetch
    fails) and host 0 deletes its copy; every host dispatched the same at every step."""
    from tpuoffload.sim.podslice import SliceSpec
    from tpuoffload.sim.workload import PrefixRepetition, run_prefix_repetition

    config = {"num_cpu_chunks": RAM_CHUNKS, "disk_path": str(tmp_path / "disk-{host}"), "disk_bytes_to_use": DISK_BYTES,
              "persist_path": str(tmp_path / "ckpt"), "persist_timeout_s": 60.0, "save_timeout_s": 60.0,
              "load_wait_timeout_s": 2.0}
    spec = SliceSpec(num_hosts=2, devices_per_host=2, num_kv_heads=8, num_blocks=48, max_num_seqs=16,
                     max_num_batched_tokens=256, extra_config=config, step_timeout_s=90.0)

    def serve(pod, waves: int):
        workload = PrefixRepetition(num_prefixes=4, prefix_blocks=8, suffix_len=(8, 16), output_len=(4, 8),
                                    num_requests=24, waves=waves, arrivals_per_step=4, seed=2)
        res = run_prefix_repetition(pod, workload)
        assert res.wrong_outputs == [] and res.finished + res.aborted == res.requests, res
        states = pod.worker_state()
        assert all(s["mismatches"] == 0 and s["positions_verified"] > 0 for s in states), states
        assert all(len(set(step)) == 1 for step in pod.digests)
        return pod.stats.totals()

    first = make_slice(spec)
    assert serve(first, waves=3)[C.SPILLS_CONFIRMED] > 0
    first.shutdown()
    names = [sorted(glob.glob(str(tmp_path / f"disk-{h}" / "*.kv"))) for h in range(2)]
    assert [os.path.basename(n) for n in names[0]] == [os.path.basename(n) for n in names[1]] and names[0]
    lost = names[1][0]
    os.unlink(lost)
    host0_copy = names[0][0]
    restarted = time.time()

    second = make_slice(spec)
    totals = serve(second, waves=1)
    assert totals[C.DISK_RESTORED_READY] == len(names[0]) - 1 and totals[C.DISK_RESTORED_DROPPED] == 1, totals
    assert totals[C.FETCHES_ISSUED] > 0 and totals[C.FETCHES_FAILED] == 0 and totals[C.LOAD_ERRORS] == 0, totals
    assert totals[C.DISK_READ_CHUNKS] == 2 * totals[C.FETCHES_ISSUED]  # read back on both hosts, checked
    # host 0 deleted its copy (the same chunk may have been spilled again since, as a new file)
    assert not os.path.exists(host0_copy) or os.path.getmtime(host0_copy) > restarted
    second.close()
