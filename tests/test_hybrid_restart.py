"""Issue 21, stage 5 (part): warm restart carries the KV cache group. A chunk's key is its content
hash mixed with its group (manager/kv_groups.py), and the hosts checkpoint each slot's key, so a
restart on a hybrid layout (gpt-oss-like, vLLM's hybrid KV cache manager on) restores every group's
chunks and the next wave hits them: the runner checks every position each step reads (sliding
windows included), and the restored hits must be as long as before the restart."""

from __future__ import annotations

import dataclasses
import random

from tpuoffload import counters as C
from tpuoffload.sim.engine import EngineSpec, InProcessEngine
from tpuoffload.sim.hybrid_layouts import GPT_OSS_LIKE
from tpuoffload.sim.vllm_setup import make_request

SPEC = dataclasses.replace(GPT_OSS_LIKE, max_model_len=1024)
BS = SPEC.block_size


def _engine(persist: str) -> InProcessEngine:
    return InProcessEngine(EngineSpec(num_hosts=1, hybrid=SPEC, kv_budget_bytes=8 << 20,
                                      extra_config={"num_cpu_chunks": 256, "persist_path": persist}))


def _wave(engine: InProcessEngine, tag: str, prefixes, rng) -> None:
    for i, p in enumerate(prefixes):
        engine.add_request(make_request(f"{tag}{i}", p + [rng.randrange(10, 30000) for _ in range(9)],
                                        max_tokens=4, block_size=BS))
    engine.run()
    engine.settle()


def test_restart_restores_every_groups_chunks_and_hits_them(tmp_path):
    persist = str(tmp_path / "ckpt")
    rng = random.Random(5)
    prefixes = [[rng.randrange(10, 30000) for _ in range(n * BS)] for n in (18, 11, 3)]
    first = _engine(persist)
    first.settle()  # saves wait for the hosts' (cold) restore report
    _wave(first, "a", prefixes, rng)
    saved = first.stats.totals()[C.CHUNKS_SAVED]
    assert saved == 2 * sum(len(p) for p in prefixes) // BS  # every prefix block of both groups
    assert first.mismatches() == 0
    first.close()  # clean shutdown: the host writes its checkpoint

    second = _engine(persist)
    second.settle()  # the hosts' restore report reaches the scheduler (a request before it would miss)
    _wave(second, "b", prefixes, rng)
    totals = second.stats.totals()
    assert totals[C.PERSIST_RESTORED_CHUNKS] == saved and totals[C.RESTORED_READY] == saved
    assert totals[C.HIT_TOKENS] == sum(len(p) for p in prefixes)
    assert totals[C.CHUNKS_LOADED] > 0 and totals[C.LOAD_ERRORS] == 0
    assert second.mismatches() == 0 and second.runners[0].stats.positions_verified > 0
    second.close()
