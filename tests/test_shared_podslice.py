"""The shared tier's proof on pod slices (issue 37): two slices of 2 JAX processes each (the hosts
of each slice are separate processes, joined by jax.distributed; each holds only its heads of every
block) share one directory, or one redis-server. Slice A computes a prefix workload; slice B,
started after A shut down, serves A's prefixes from the store: every output equals what the
synthetic model computes from scratch (``wrong_outputs``), every context position every host read
is right, and every host dispatched the same at every step (the slice checks digests each step).
The hazard with separate processes: one host's shard objects corrupt on the store -> a miss on
every host (B's fetches fail everywhere, nothing is loaded, digests identical).

The figures this test prints are the table in docs/design.md ("The shared tier")."""

from __future__ import annotations

import glob
import os

import pytest

from tpuoffload import counters as C


def _spec(url: str):
    from tpuoffload.sim.podslice import SliceSpec

    config = {"num_cpu_chunks": 64, "shared_url": url, "save_timeout_s": 30.0, "load_wait_timeout_s": 10.0}
    return SliceSpec(num_hosts=2, devices_per_host=2, num_kv_heads=8, num_blocks=64, max_num_seqs=16,
                     max_num_batched_tokens=256, extra_config=config, step_timeout_s=120.0)


def _workload():
    from tpuoffload.sim.workload import PrefixRepetition

    return PrefixRepetition(num_prefixes=4, prefix_blocks=6, suffix_len=(8, 16), output_len=(4, 8),
                            num_requests=8, waves=1, arrivals_per_step=4, seed=5)


def _serve(pod):
    from tpuoffload.sim.workload import run_prefix_repetition

    res = run_prefix_repetition(pod, _workload())
    assert res.wrong_outputs == [] and res.finished == res.requests, res
    states = pod.worker_state()
    assert all(s["mismatches"] == 0 and s["positions_verified"] > 0 for s in states), states
    assert all(len(set(step)) == 1 for step in pod.digests)  # (the slice raises at the first divergence)
    return pod.stats.totals()


def _table_row(backend: str, a, b) -> str:
    hit = b[C.HIT_TOKENS] / max(1, b[C.LOOKUP_TOKENS])
    return (f"shared tier, {backend}: slice B hit rate {hit:.2f} ({b[C.HIT_TOKENS]} of {b[C.LOOKUP_TOKENS]} prompt "
            f"tokens), chunks fetched {b[C.SHARED_FETCHES_READY]}, bytes written by A {a[C.SHARED_WRITTEN_BYTES]}, "
            f"read by B {b[C.SHARED_READ_BYTES]}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_slices_share_prefixes_through_the_store(make_slice, shared_url):
    first = make_slice(_spec(shared_url))
    a = _serve(first)
    assert a[C.SHARED_WRITTEN_CHUNKS] > 0 and a[C.SHARED_FETCHES_READY] == 0, a
    first.shutdown()  # the hosts finish their background writes
    second = make_slice(_spec(shared_url))
    b = _serve(second)
    print(_table_row(shared_url.split(":")[0], a, b))
    assert b[C.SHARED_FETCHES_READY] > 0 and b[C.SHARED_FETCHES_FAILED] == 0, b
    assert b[C.HIT_TOKENS] > 0 and b[C.LOAD_ERRORS] == 0, b  # vLLM's external prefix cache hits on B
    assert b[C.SHARED_READ_CHUNKS] == 2 * b[C.SHARED_FETCHES_READY], b  # each host read and verified its shard
    second.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("damage", ["corrupt", "none (control)"])
def test_one_hosts_shard_corrupt_is_a_miss_on_every_host(make_slice, tmp_path, damage):
    url = f"file://{tmp_path}/lustre-kv?timeout_s=30"
    first = make_slice(_spec(url))
    _serve(first)
    first.shutdown()
    objects = glob.glob(str(tmp_path / "lustre-kv" / "*" / "h1of2" / "*" / "*.kv"))
    assert objects
    if damage == "corrupt":
        for path in objects:  # one flipped bit in host 1's payloads only
            with open(path, "r+b") as f:
                f.seek(128 + 100)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 1]))
    second = make_slice(_spec(url))
    b = _serve(second)
    if damage == "corrupt":
        assert b[C.SHARED_FETCHES_ISSUED] > 0 and b[C.SHARED_FETCHES_READY] == 0, b
        assert b[C.SHARED_FETCHES_FAILED] == b[C.SHARED_FETCHES_ISSUED], b
        assert b[C.SHARED_MISS_CORRUPT] > 0 and b[C.SHARED_READ_CHUNKS] > 0, b  # host 0 verified its own
        assert b[C.CHUNKS_LOADED] == 0, b  # nothing was loaded on any host
    else:
        assert b[C.SHARED_FETCHES_READY] > 0 and b[C.SHARED_FETCHES_FAILED] == 0, b
    second.close()
