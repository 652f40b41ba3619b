"""Issue 36: vLLM's own hand-off of GDN/mamba boundary states against tpuoffload's exact-boundary rule.

vLLM 0.32's ``Scheduler.schedule`` drains ``KVCacheManager.take_boundary_state_offloads`` into
``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``: per request, ``(group, block,
boundary tokens)`` of the mamba "align" state blocks it offers a connector. ``MambaManager`` fills
it from two places (``vllm/v1/core/single_type_kv_cache_manager.py``):

* ``cache_blocks``: every newly cached (hashed, non-null) state block, with its
  ``block_hash_num_tokens``, for every mamba group (the mirror groups offer the same block id).
  Align mode retains (hashes) a state only at the boundaries its prefix cache keeps
  (``reachable_block_mask``, ``get_mamba_prefill_checkpoint_position``): here the prompt's last
  block boundary, ``(len - 1) // block * block``; the other boundaries' blocks carry no hash;
* ``allocate_new_blocks``: the copy-on-write block of a producer's partial tail, a state at a
  boundary inside a block (``_cache_partial_tail_block``: only when ``num_tokens % block_size``,
  i.e. when vLLM hashes in blocks smaller than the mamba block).

tpuoffload derives its state rows itself (``KVCacheGroups.state_ids``, fed by
``RequestLifecycle.step_spans``): the state group's row at column ``full - 1`` of a step that ends
exactly at block ``full``, prompt blocks only unless ``save_decode_blocks``. This test runs a GDN
workload on vLLM's real Scheduler with tpu-inference's hybrid coordinator (mamba cache mode "align",
one block size for every group, as tpu-inference configures it: ``sim/gdn_layout.py``), records
both per step and asserts the relation exactly.
"""

from __future__ import annotations

import collections
import dataclasses
import random

from tpuoffload.sim import gdn_layout as gl
from tpuoffload.sim.engine import EngineSpec, InProcessEngine

from test_gdn_offload import _tokens

SPEC = dataclasses.replace(gl.QWEN35_LIKE, max_num_seqs=4, max_num_batched_tokens=64)
BS = SPEC.block_size


def _record(save_decode_blocks: bool):
    """Run the workload; per step, vLLM's hand-off entries and tpuoffload's state-row candidates,
    each as {(request, boundary tokens): block id} (vLLM's per group)."""
    extra = {"num_cpu_chunks": 128, "state_ram_fraction": 0.5, "save_decode_blocks": save_decode_blocks}
    eng = InProcessEngine(EngineSpec(gdn=SPEC, extra_config=extra))
    off = eng.offload
    groups = off.kv_groups
    state = groups.state_group
    vllm_steps: list[dict] = []
    ours_steps: list[dict] = []
    requests = off._step_saves._requests
    spans = requests.step_spans

    def recorded_spans(so):
        out = spans(so)
        mine = {}
        for r, _, full, exact in out:
            ids = groups.state_ids(off._block_ids(r.request_id), full, exact)[state]
            if exact and full and ids[full - 1]:
                mine[r.request_id, full * BS] = ids[full - 1]
        ours_steps.append(mine)
        return out

    requests.step_spans = recorded_spans
    connector = eng.scheduler.connector  # vLLM's Scheduler calls it with each SchedulerOutput
    build = connector.build_connector_meta

    def recorded_build(so):
        handoff = collections.defaultdict(dict)
        block_state = so.kv_connector_block_state
        assert block_state is not None  # a connector is configured: vLLM always offers the state
        for req, entries in block_state.boundary_state_offloads.items():
            for g, block, tokens in entries:
                handoff[g][req, tokens] = block
        vllm_steps.append(dict(handoff))
        return build(so)

    connector.build_connector_meta = recorded_build
    rng = random.Random(11)
    # Prompts ending inside a block and exactly at a block boundary; chunked prefill (64 tokens a
    # step, 4 blocks) over longer ones; decode crossing block boundaries.
    prompts = [_tokens(rng, n) for n in (5 * BS + 7, 4 * BS, 9 * BS + 3, 2 * BS + 15)]
    for wave in range(2):  # the second wave repeats them: vLLM's own prefix cache hits
        for i, p in enumerate(prompts):
            eng.add_request(gl.make_request(eng.gdn_layout, f"{wave}-{i}", p, max_tokens=BS))
        eng.run()
        eng.settle()
    eng.close()
    assert len(vllm_steps) == len(ours_steps)
    return groups, vllm_steps, ours_steps, prompts


def test_vllm_boundary_state_handoff_against_the_exact_boundary_rule():
    """What vLLM 0.32 offers (state group) is a subset of what tpuoffload saves, block for block,
    in the same step: the last prompt boundary a step computes, ``(len - 1) // block * block``
    (the hit boundary vLLM's own prefix cache keeps: ``get_mamba_prefill_checkpoint_position``).
    tpuoffload also saves every other exact boundary a step ends at (a chunked prefill's earlier
    boundaries, a prompt that ends on a boundary), which vLLM neither retains nor offers; vLLM
    offers no decode boundary and, with one block size for every group, no partial tail."""
    groups, vllm_steps, ours_steps, prompts = _record(save_decode_blocks=False)
    mamba = [g for g, p in enumerate(groups.pools) if p == 1]
    state = groups.state_group
    both, only_ours = 0, collections.Counter()
    for step, (theirs, ours) in enumerate(zip(vllm_steps, ours_steps)):
        # vLLM offers the mamba groups only, every mamba group the same block (tpu-inference's
        # hybrid coordinator mirrors the first group's ids): one tpuoffload state chunk holds them.
        assert set(theirs) <= set(mamba), (step, theirs)
        for g in theirs:
            assert theirs[g] == theirs[state], (step, g)
        offered = theirs.get(state, {})
        # Every boundary vLLM offers, tpuoffload saves too: the same block, in the same step.
        assert not offered.keys() - ours.keys(), (step, offered, ours)
        for key in offered:
            assert offered[key] == ours[key], (step, key, offered[key], ours[key])
            req, tokens = key
            assert tokens == (len(prompts[int(req.split("-")[1])]) - 1) // BS * BS, key
            both += 1
        for req, tokens in ours.keys() - offered.keys():
            length = len(prompts[int(req.split("-")[1])])
            last = (length - 1) // BS * BS  # the prompt's hit boundary: offered whenever computed
            assert tokens != last and tokens % BS == 0, (step, req, tokens)
            only_ours["earlier chunk boundary" if tokens < last else
                      "prompt ends on a boundary" if tokens == length else "decode"] += 1
    print(f"boundaries both name: {both}; only tpuoffload: {dict(only_ours)}; only vLLM: 0")
    assert both >= len(prompts)  # the first wave computes every prompt's hit boundary
    assert only_ours["earlier chunk boundary"] > 0 and only_ours["prompt ends on a boundary"] > 0
    assert only_ours["decode"] == 0  # save_decode_blocks is off
