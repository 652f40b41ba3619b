"""Issue 21, stage 2: load failures with several KV cache groups (vLLM's hybrid KV cache manager).

vLLM 0.32 refuses block-level load errors once a model has more than one KV cache group
(``Scheduler._handle_invalid_blocks`` raises: block ids are unique only within a group) and takes
failed requests through ``failed_recving`` of asynchronous loads instead: a request some worker
reports failed (and finished) is released once every worker reported it finished, its computed
tokens reset to 0, its blocks freed, and it is recomputed (``_handle_failed_recving``,
``_update_waiting_for_remote_kv``; ``KVOutputAggregator`` keeps a failure until the request is
finished on every worker). One scheduler decides for every host, so every host recomputes alike.

Faults are injected on one host of two, under vLLM's real ``Scheduler`` and ``AsyncScheduler``;
the runner checks every context position each step reads on every host.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
from offload_harness import Harness, LoseSlots, rand_tokens

from tpuoffload.sim.hybrid_layouts import GPT_OSS_LIKE

BS = GPT_OSS_LIKE.block_size
SPEC = dataclasses.replace(GPT_OSS_LIKE, max_model_len=1024)
BUDGET = 8 << 20
VARIANTS = [pytest.param(False, id="Scheduler"), pytest.param(True, id="AsyncScheduler")]


def _harness(async_scheduling, fault):
    h = Harness(hosts=2, async_scheduling=async_scheduling, hybrid=SPEC, kv_budget_bytes=BUDGET,
                extra={"num_cpu_chunks": 256}, faults=[None, fault])
    # Every KVConnectorOutput vLLM receives: with several groups it must never carry block ids.
    h.outputs_seen = []
    orig = h.eng._process

    def process(so, out):
        h.outputs_seen.append(out.kv_connector_output)
        return orig(so, out)

    h.eng._process = process
    return h


@pytest.mark.parametrize("async_scheduling", VARIANTS)
def test_failed_load_on_one_host_is_recomputed_on_every_host(async_scheduling):
    fault = LoseSlots(times=1)
    h = _harness(async_scheduling, fault)
    try:
        rng = random.Random(7)
        prefixes = [rand_tokens(rng, n * BS) for n in (12, 6)]
        for i, p in enumerate(prefixes):
            h.add(f"a{i}", p + rand_tokens(rng, 5), max_tokens=5)
        h.run()
        h.new_wave()
        for i in range(len(prefixes)):
            h.add(f"b{i}", h.prompts[f"a{i}"], max_tokens=5)
        h.run(max_steps=300)
        h.check_idle()  # no host ever read a wrong KV value; nothing leaked
        assert fault.lost == 1
        # Reported by request, never by block id (vLLM would raise with several groups).
        outs = [o for o in h.outputs_seen if o is not None]
        assert not any(o.invalid_block_ids for o in outs)
        failed = set().union(*(o.failed_recving for o in outs))
        assert len(failed) == 1
        (req,) = failed
        # vLLM recomputed it (same tokens as the first wave, which computed everything).
        assert h.eng.finished == set(h.prompts)
        for i in range(len(prefixes)):
            assert h.eng.outputs[f"b{i}"] == h.eng.outputs[f"a{i}"]
        # Every chunk that failed request's load read is dropped, and never offered again.
        loads = [(step, ld) for step, m in enumerate(h.metas()) for ld in m.loads]
        step, failed_load = next((s, ld) for s, ld in loads if ld.req_id == req)
        assert h.eng.stats.totals()["discarded"] == len(failed_load.save_ids) > 0
        assert h.eng.stats.totals()["failed_requests"] == 1
        later = {sid for s, ld in loads if s != step for sid in ld.save_ids}
        assert later.isdisjoint(failed_load.save_ids)
        # The other request's loads landed byte-exact on both hosts.
        assert h.check_loaded_bytes(min_blocks=1) > 0
        assert {host for host, *_ in h.loaded} == {0, 1}
    finally:
        h.close()


@pytest.mark.parametrize("async_scheduling", VARIANTS)
def test_persistent_load_failures_do_not_loop(async_scheduling):
    """Host 1 loses every slot it reads: each attempt fails, its chunks go, vLLM recomputes, the
    chunks are saved again, and the requests still finish with the same tokens."""
    fault = LoseSlots(times=10**9, every=True)
    h = _harness(async_scheduling, fault)
    try:
        rng = random.Random(8)
        prompt = rand_tokens(rng, 10 * BS + 4)
        h.add("a", prompt, max_tokens=3)
        h.run()
        for wave in range(3):
            h.new_wave()
            for k in range(2):
                h.add(f"b{wave}{k}", prompt, max_tokens=3)
            h.run(max_steps=200)
        h.check_idle()
        assert fault.lost > 0
        outs = [o for o in h.outputs_seen if o is not None]
        assert not any(o.invalid_block_ids for o in outs)
        attempts = Counter(ld.req_id for m in h.metas() for ld in m.loads)
        assert attempts and max(attempts.values()) <= 2
        for sid in {sid for m in h.metas() for ld in m.loads for sid in ld.save_ids}:
            steps = {i for i, m in enumerate(h.metas()) for ld in m.loads if sid in ld.save_ids}
            assert len(steps) == 1, (sid, steps)
        assert h.eng.finished == set(h.prompts)
        assert all(h.eng.outputs[r] == h.eng.outputs["a"] for r in h.prompts)
    finally:
        h.close()


@pytest.mark.parametrize("async_scheduling", VARIANTS)
def test_hit_no_longer_servable_at_admission_fails_the_request_without_a_copy(async_scheduling):
    """A chunk of the hit vLLM was promised goes between the lookup and the admission (as an
    eviction by another request's save would): the load is sent as a failure with nothing to copy,
    every host reports it, and vLLM recomputes the request."""
    h = _harness(async_scheduling, None)
    try:
        rng = random.Random(9)
        prompt = rand_tokens(rng, 12 * BS + 3)
        h.add("a", prompt, max_tokens=4)
        h.run()
        h.new_wave()
        off = h.eng.offload
        lookup = h.eng.scheduler.connector.get_num_new_matched_tokens
        gone = []

        def get_num_new_matched_tokens(request, num_computed_tokens):
            tokens, is_async = lookup(request, num_computed_tokens)
            if tokens and not gone:  # drop the full-attention group's chunk of block 3
                from tpuoffload.manager.kv_groups import chunk_hash

                slot = off.index.slot_of(chunk_hash(request.block_hashes[3], 1))
                gone.append(off.index.discard(slot, off.index.save_id_of(slot)))
            return tokens, is_async

        h.eng.scheduler.connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        h.add("b", prompt, max_tokens=4)
        h.run(max_steps=200)
        h.check_idle()
        assert gone == [True]
        first, *retries = [ld for m in h.metas() for ld in m.loads]
        assert first.req_id == "b" and not first.block_ids and first.unavailable_block_ids
        # Recomputed from scratch, it may hit what is left (the blocks before the dropped one).
        assert all(ld.req_id == "b" and len(ld.block_ids) < len(first.unavailable_block_ids) for ld in retries)
        if retries:
            assert h.check_loaded_bytes() > 0
        outs = [o for o in h.outputs_seen if o is not None]
        assert not any(o.invalid_block_ids for o in outs)
        assert set().union(*(o.failed_recving for o in outs)) == {"b"}
        assert h.eng.outputs["b"] == h.eng.outputs["a"]
    finally:
        h.close()
