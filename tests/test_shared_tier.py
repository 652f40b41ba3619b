"""The shared tier wired into both halves (issue 37), on vLLM's real scheduler: two engines of two
hosts each share one store; a prefix engine A computed is served on engine B from the store,
byte-exact (the synthetic runner checks every context position B reads), with the tokens B gets
when it recomputes. Each hazard is reproduced in process here; the pod-slice proof (separate
processes) is tests/test_shared_podslice.py."""

from __future__ import annotations

import glob
import os

import pytest

from tpuoffload import counters as C

RAM_CHUNKS = 64


def _engine(url: str | None, num_hosts: int = 2, **extra):
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine

    config = {"num_cpu_chunks": RAM_CHUNKS, **extra}
    if url is not None:
        config["shared_url"] = url
    return InProcessEngine(EngineSpec(num_hosts=num_hosts, num_blocks=64, extra_config=config))


def _wave(tag: str):
    from tpuoffload.sim.workload import prefix_repetition

    return prefix_repetition(6, 3, 64, 24, 4, seed=3, id_prefix=tag, block_size=16)


def _serve(engine, requests) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    engine.run()
    engine.settle()
    for conn in engine.connectors:  # publishes are background writes: wait for them
        assert conn.worker.wait_idle(30)
    engine.settle()
    return {rid[1:]: toks for rid, toks in engine.outputs.items()}


def _assert_clean(engine) -> None:
    assert engine.mismatches() == 0
    leaks = engine.offload.leak_report()
    assert all(v == 0 for v in leaks.values()), leaks
    for conn in engine.connectors:
        assert all(v == 0 for v in conn.worker.idle_report().values()), conn.worker.idle_report()


def _objects(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "*", "*", "*", "*.kv")))


@pytest.fixture(params=["file", "redis"])
def store_url(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path}/shared?timeout_s=20"
    else:
        from tpuoffload.sim.redis_server import RedisServer

        with RedisServer() as server:
            yield f"{server.url}?timeout_s=20"


def test_a_prefix_computed_on_engine_a_is_served_on_engine_b_byte_exact(store_url):
    a = _engine(store_url)
    out_a = _serve(a, _wave("a"))
    ta = a.stats.totals()
    assert ta[C.SHARED_WRITTEN_CHUNKS] > 0 and ta[C.SHARED_WRITTEN_CHUNKS] == 2 * ta[C.SHARED_PUBLISH_ISSUED] - ta[C.SHARED_WRITE_EXISTS], ta
    _assert_clean(a)
    a.close()

    b = _engine(store_url)
    out_b = _serve(b, _wave("b"))
    tb = b.stats.totals()
    assert tb[C.SHARED_FETCHES_READY] > 0 and tb[C.SHARED_FETCHES_FAILED] == 0, tb
    assert tb[C.HIT_TOKENS] >= tb[C.SHARED_FETCHES_READY] * 16 > 0, tb
    assert tb[C.SHARED_READ_CHUNKS] == 2 * tb[C.SHARED_FETCHES_READY], tb  # both hosts read their shard
    assert tb[C.LOAD_ERRORS] == 0 and tb[C.SHARED_PUBLISH_ISSUED] == 0  # what came from the store is not sent back
    _assert_clean(b)
    b.close()

    control = _engine(None)  # the same prompts recomputed, no shared tier
    out_c = _serve(control, _wave("c"))
    assert control.stats.totals()[C.HIT_TOKENS] == 0
    control.close()
    assert out_b == out_c == out_a
