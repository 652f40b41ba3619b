"""Issue 21, GDN (Gated DeltaNet / mamba) hybrids: the runtime facts of a Qwen3.5-like model (3 GDN
layers to 1 full-attention layer, 8 layers) under tpu-inference 0.32 with prefix caching (mamba cache
mode "align") and HMA on, measured from tpu-inference's and vLLM's installed code
(``tpuoffload.sim.gdn_layout``), and the worker half's two slot pools for it (the scheduler half's:
tests/test_state_pool_scheduler.py; both: tests/test_state_pool_worker.py)."""

from __future__ import annotations

import copy
import dataclasses
import random

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpuoffload.layout import CacheLayout, UnsupportedCache
from tpuoffload.sim import gdn_layout as gl

SPEC = gl.QWEN35_LIKE
BS = SPEC.block_size
CONV_DIM = 2 * SPEC.linear_num_key_heads * SPEC.linear_key_head_dim + \
    SPEC.linear_num_value_heads * SPEC.linear_value_head_dim  # q, k and v go through the conv
CONV_SHAPE = (SPEC.linear_conv_kernel_dim - 1, CONV_DIM)
SSM_SHAPE = (SPEC.linear_num_value_heads, SPEC.linear_value_head_dim, SPEC.linear_key_head_dim)
MAMBA_PAGE = int(np.prod(CONV_SHAPE)) * 2 + int(np.prod(SSM_SHAPE)) * 4  # bf16 conv, float32 ssm
ATTN_PAGE = BS * 4 * 2 * 128 * 2  # the measured TPU array row: (16, 4, 2, 128) bf16


@pytest.fixture(scope="module")
def layout():
    return gl.build(SPEC)


def _rng_tokens(rng, n):
    return [rng.randrange(3, 30000) for _ in range(n)]


# ------------------------------------------------------------------ specs, pools, groups, arrays
def test_specs_tpu_inference_reports(layout):
    cc = layout.vllm_config.cache_config
    # vLLM's hybrid hook chose align mode (prefix caching on) with mamba blocks of block_size tokens.
    assert (cc.mamba_cache_mode, cc.mamba_block_size, cc.mamba_ssm_cache_dtype) == ("align", BS, "float32")
    kinds = {name: type(s).__name__ for name, s in layout.kv_cache_specs.items()}
    assert kinds == {**{n: "MambaSpec" for n in SPEC.gdn_layers},
                     **{n: "FullAttentionSpec" for n in SPEC.attention_layers}}
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    for name in SPEC.gdn_layers:
        s = layout.kv_cache_specs[name]
        assert s.shapes == (CONV_SHAPE, SSM_SHAPE) == ((3, 512), (8, 32, 32))
        assert s.dtypes == (torch.bfloat16, torch.float32)
        assert (s.mamba_type, s.mamba_cache_mode, s.block_size) == (MambaAttentionBackendEnum.GDN_ATTN, "align", BS)
        assert s.real_page_size_bytes == MAMBA_PAGE == 35840
    for name in SPEC.attention_layers:
        s = layout.kv_cache_specs[name]
        assert (s.num_kv_heads, s.head_size, s.block_size) == (4, 64, BS)  # 2 KV heads padded to tp=4
    # update_mamba_page_size_padded: one page for every layer = 1 attention page + 3 unpadded mamba
    # pages (vLLM groups 2 attention + 6 GDN layers as 1 attention group and 3 mamba groups).
    uniform = ATTN_PAGE + 3 * MAMBA_PAGE
    assert {s.page_size_bytes for s in layout.kv_cache_specs.values()} == {uniform} == {140288}
    assert cc.mamba_page_size_padded == uniform


def test_compact_mamba_pool_and_attention_pool(layout):
    cc = layout.vllm_config.cache_config
    # max_num_reqs = max(max_num_seqs, MIN_NUM_SEQS) on the runner; align mode reserves 8 blocks per request.
    assert layout.max_num_reqs == max(SPEC.max_num_seqs, gl.min_num_seqs()) == 8
    assert layout.mamba_num_blocks == layout.max_num_reqs * 8 + 1 == 65
    assert layout.available_memory == int(SPEC.hbm_bytes * SPEC.gpu_memory_utilization)
    attn = (layout.available_memory - 65 * 6 * MAMBA_PAGE) // (2 * ATTN_PAGE)  # the rest goes to attention
    assert layout.attention_num_blocks == attn == 362
    assert cc.num_gpu_blocks_override == 362 and layout.kv_cache_config.num_blocks == 362
    # propagate_mamba_num_blocks carried M to the scheduler's config.
    assert layout.kv_cache_config.mamba_num_blocks == cc.mamba_num_blocks == 65
    # The patched HBM query is confined to the build.
    utils = gl.tpu_inference().utils
    with pytest.raises(RuntimeError, match="Expected TPU devices"):
        utils.hbm_usage_bytes(layout.mesh.devices.flatten())


def test_smaller_budget_resplits_both_pools():
    """Both pools over the budget at 8 requests: tpu-inference re-splits at the request count both
    can serve (5 here): M = 5 * 8 + 1."""
    small = gl.build(dataclasses.replace(SPEC, hbm_bytes=24 << 20))
    assert (small.mamba_num_blocks, small.attention_num_blocks) == (41, 211)
    assert {a.shape[0] for c in small.kv_caches if isinstance(c, tuple) for a in c} == {41}


def test_groups_and_tensors(layout):
    cfg = layout.kv_cache_config
    assert layout.group_kinds() == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    names = SPEC.layer_names()
    assert [g.layer_names for g in cfg.kv_cache_groups] == [[names[i], names[i + 4]] for i in range(4)]
    assert all(g.kv_cache_spec.block_size == BS for g in cfg.kv_cache_groups)
    assert (layout.scheduler_block_size, layout.hash_block_size) == (BS, BS)
    # vLLM's tensors: one per group, sized at the uniform page for every layer and block, which is
    # not what tpu-inference allocates (each layer its own array; mamba arrays of M rows).
    tensors = layout.worker_kv_cache_config.kv_cache_tensors
    assert [t.layers for t in tensors] == [g.layer_names for g in cfg.kv_cache_groups]
    assert {t.size for t in tensors} == {2 * 362 * 140288}
    allocated = sum(a.nbytes for c in layout.kv_caches for a in (c if isinstance(c, tuple) else (c,)))
    assert allocated == 2 * 362 * ATTN_PAGE + 6 * 65 * MAMBA_PAGE <= layout.available_memory


def test_runner_arrays(layout):
    caches, index = layout.kv_caches, layout.layer_name_to_kvcache_index
    assert layout.state_layers() == [0, 1, 2, 3, 4, 5]
    for i in range(6):
        conv, ssm = caches[i]
        assert (conv.shape, conv.dtype, ssm.shape, ssm.dtype) == \
            ((65,) + CONV_SHAPE, jnp.bfloat16, (65,) + SSM_SHAPE, jnp.float32)
        assert tuple(conv.sharding.spec) == ("data", None, "model")
        assert tuple(ssm.sharding.spec) == ("data", "model", None, None)
    for i in (6, 7):
        assert (caches[i].shape, caches[i].dtype) == ((362, BS, 4, 2, 128), jnp.bfloat16)
        assert tuple(caches[i].sharding.spec) == ("data", None, "model")
    # One array per layer, in group order.
    names = SPEC.layer_names()
    assert index == {names[0]: 0, names[4]: 1, names[1]: 2, names[5]: 3, names[2]: 4, names[6]: 5,
                     names[3]: 6, names[7]: 7}


# ------------------------------------------------------------------ the scheduler side
def test_scheduler_uses_tpu_hybrid_coordinator(layout):
    import vllm.v1.core.kv_cache_coordinator as coord_mod
    import vllm.v1.core.sched.scheduler as sched_mod

    sched, installed = gl.make_scheduler(layout)
    assert installed
    co = sched.kv_cache_manager.coordinator
    assert (type(sched.kv_cache_manager).__name__, type(co).__name__) == ("TPUKVCacheManager",
                                                                          "TPUHybridKVCacheCoordinator")
    assert (co.attention_block_pool.num_gpu_blocks, co.mamba_block_pool.num_gpu_blocks) == (362, 65)
    assert (co.mamba_group_ids, co.mirror_mamba_groups, co.primary_mamba_group_id) == ({0, 1, 2}, True, 0)
    # vLLM's modules are put back once the scheduler is built; the scheduler keeps tpu-inference's manager.
    assert coord_mod.get_kv_cache_coordinator.__module__ == "vllm.v1.core.kv_cache_coordinator"
    assert sched_mod.KVCacheManager.__module__ == "vllm.v1.core.kv_cache_manager"


def test_align_mode_keeps_the_state_block_of_the_last_boundary(layout):
    sched, _ = gl.make_scheduler(layout)
    rng = random.Random(3)
    prompt = _rng_tokens(rng, 5 * BS + 3)
    sched.add_request(gl.make_request(layout, "a", prompt, max_tokens=3))
    null = [0] * 4

    so = gl.step(sched)  # align mode: 5 full blocks first, the 3-token tail next step
    assert so.num_scheduled_tokens == {"a": 5 * BS}
    m0, m1, m2, attn = gl.block_table(sched, "a")
    assert m0 == m1 == m2  # mirrored mamba groups share ids
    col = gl.state_block_column(5 * BS, BS)
    assert col == 4 and m0[:col] == null and len(m0) == col + 1 and 0 < m0[col] < 65
    after_80 = m0[col]
    assert len(attn) == 5 and 0 not in attn and len(set(attn)) == 5

    so = gl.step(sched)  # the tail: the new state goes to column 5; column 4 is still held
    assert so.num_scheduled_tokens == {"a": 3}
    m0, *_, attn = gl.block_table(sched, "a")
    assert gl.state_block_column(5 * BS + 3, BS) == 5
    assert m0[:4] == null and m0[4] == after_80 and 0 < m0[5] < 65 and m0[5] != after_80
    after_83 = m0[5]

    gl.step(sched)  # first decode step: the column-4 state is released (kept in the prefix cache)
    m0, *_ = gl.block_table(sched, "a")
    assert m0 == null + [0, after_83]
    attn_a = attn
    while sched.requests:
        gl.step(sched)

    # Same 5-block prefix: a 80-token hit whose mamba state is the block that held it for "a".
    sched.add_request(gl.make_request(layout, "b", prompt[:5 * BS] + _rng_tokens(rng, 20), max_tokens=2))
    so = gl.step(sched)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 5 * BS
    m0, m1, m2, attn = new.block_ids
    assert m0[:4] == null and m0[4] == after_80
    assert list(attn[:5]) == attn_a[:5]


@pytest.mark.parametrize("hooks", [True, False], ids=["tpu-coordinator", "stock-vllm"])
def test_mamba_ids_are_rows_of_the_compact_pool(layout, hooks):
    """With tpu-inference's coordinator every id a mamba group gets is a row of the M-row state
    arrays while attention ids run past M; stock vLLM's coordinator (one shared pool) hands the
    mamba groups ids past M, rows the runner never allocated."""
    sched, _ = gl.make_scheduler(layout, hooks=hooks)
    rng = random.Random(1)
    for i in range(4):
        sched.add_request(gl.make_request(layout, f"r{i}", _rng_tokens(rng, 20 * BS), max_tokens=4))
    seen = [set() for _ in range(4)]
    for _ in range(50):
        if not sched.requests:
            break
        gl.step(sched)
        for r in sched.requests:
            for g, ids in enumerate(gl.block_table(sched, r)):
                seen[g] |= set(ids)
    assert not sched.requests
    mamba_max = max(max(seen[g]) for g in range(3))
    assert layout.mamba_num_blocks < max(seen[3]) < layout.attention_num_blocks
    if hooks:
        assert mamba_max < layout.mamba_num_blocks
        assert seen[0] == seen[1] == seen[2]
    else:
        assert mamba_max >= layout.mamba_num_blocks


# ------------------------------------------------------------------ tpuoffload's worker half
@pytest.fixture(scope="module")
def connector_config(layout):
    vc = gl.make_vllm_config(SPEC, {"num_cpu_chunks": 16})
    assert not vc.scheduler_config.disable_hybrid_kv_cache_manager  # HMA stays on with this connector
    return vc


def test_worker_half_accepts_the_state_pool(layout, connector_config):
    """The worker half keeps the state tuples in a second slot pool (worker/pooled_engine.py,
    tests/test_state_pool_worker.py); CacheLayout alone still describes one pool only."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpuoffload.connector import TPUOffloadConnector

    with pytest.raises(UnsupportedCache, match=r"kv_caches\[0\] is a tuple of 2 arrays: mamba/SSM state layers"):
        CacheLayout.from_caches(layout.kv_caches)
    conn = TPUOffloadConnector(connector_config, KVConnectorRole.WORKER, copy.deepcopy(layout.worker_kv_cache_config))
    conn.register_runner(layout.runner)
    try:
        engine = conn.worker.engine
        attn, state = (e.layout for e in engine.engines)
        assert [g.shape for g in attn.groups] == [(362, BS, 4, 2, 128)] and attn.num_layers == 2
        assert [g.shape for g in state.groups] == [(65, *CONV_SHAPE), (65, *SSM_SHAPE)] and state.num_layers == 12
        assert (attn.slot_bytes, state.slot_bytes) == (2 * ATTN_PAGE, 6 * MAMBA_PAGE)
        # num_cpu_chunks = 16 KV chunks of host RAM, state_ram_fraction (0.25) of them for state chunks.
        assert [t.num_slots for t in engine.tables] == [12, 4 * attn.slot_bytes // state.slot_bytes] == [12, 1]
    finally:
        conn.shutdown()


# ------------------------------------------------------------------ an external (KV connector) prefix hit
from tpuoffload.sim import vllm_setup  # noqa: E402,F401  (VLLM_TARGET_DEVICE=cpu before vLLM's platform)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA)


class ExternalHitConnector(KVConnectorBase_V1, SupportsHMA):
    """Test-only connector (built by vLLM's Scheduler from ``kv_transfer_config`` with
    ``kv_connector_module_path`` = this module): reports an external hit of ``hit_tokens`` tokens
    (``load_async``: loaded between steps) and records what the scheduler hands it."""

    hit_tokens, load_async = 0, False

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.matched: list[tuple[str, int]] = []  # get_num_new_matched_tokens(request, num_computed_tokens)
        self.allocs: list[tuple[str, int, tuple[list[int], ...]]] = []  # update_state_after_alloc

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.matched.append((request.request_id, num_computed_tokens))
        ext = max(self.hit_tokens - num_computed_tokens, 0)
        return ext, self.load_async and ext > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocs.append((request.request_id, num_external_tokens, tuple(map(list, blocks.get_block_ids()))))

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    # worker side: not used by the scheduler
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


@pytest.fixture(scope="module")
def ext_hit_config(layout):
    vc = gl.make_vllm_config(SPEC, {}, connector=("ExternalHitConnector", __name__))
    assert not vc.scheduler_config.disable_hybrid_kv_cache_manager  # HMA on (SupportsHMA), as on TPU
    assert (vc.cache_config.mamba_cache_mode, vc.cache_config.block_size) == ("align", BS)
    return vc


def _ext_hit_scheduler(layout, vc, hit_tokens, load_async):
    sched, installed = gl.make_scheduler(layout, vllm_config=vc)
    assert installed and type(sched.connector) is ExternalHitConnector
    assert type(sched.kv_cache_manager).__name__ == "TPUKVCacheManager"
    sched.connector.hit_tokens, sched.connector.load_async = hit_tokens, load_async
    return sched, sched.kv_cache_manager.coordinator


def _finish(sched, so, finished_recving=()):
    """update_from_output as the engine does after the step ran (one sampled token for a request
    whose prompt is complete; the worker connector's finished loads)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else [] for r in ids]
    kv_out = KVConnectorOutput(finished_recving=set(finished_recving)) if finished_recving else None
    sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                   sampled_token_ids=sampled, kv_connector_output=kv_out))


def _drain(sched, so, max_steps=20):
    """Finish step ``so`` and run the scheduler until every request is done."""
    _finish(sched, so)
    for _ in range(max_steps):
        if not sched.requests:
            break
        _finish(sched, sched.schedule())
    assert not sched.requests


@pytest.mark.parametrize("load_async", [True, False], ids=["async-load", "sync-load"])
def test_external_hit_gets_a_compact_pool_state_block_at_the_hit_column(layout, ext_hit_config, load_async):
    """An external hit of k = 3 full blocks on a new request, through vLLM's real Scheduler.schedule()
    with tpu-inference's TPUKVCacheManager. schedule() (vllm/v1/core/sched/scheduler.py) calls
        ext_tokens, load_kv_async = self.connector.get_num_new_matched_tokens(request, block_aligned_local)
        ...
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_tokens_past_hit,
            num_new_computed_tokens=num_new_local_computed_tokens, new_computed_blocks=new_computed_blocks,
            num_lookahead_tokens=effective_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens, delay_cache_blocks=load_kv_async, ...)
        ...
        self.connector.update_state_after_alloc(request, self.kv_cache_manager.get_blocks(request_id),
                                                num_external_computed_tokens)
    with num_tokens_past_hit = 0 for an async load (the request then waits in WAITING_FOR_REMOTE_KVS)
    and the block-aligned remaining chunk for a sync load. In the coordinator, MambaManager's
    add_local_computed_blocks pads get_num_skipped_tokens(k*16) // 16 = (k*16 - 1) // 16 = k - 1
    null blocks and allocate_external_computed_blocks adds one block from the compact mamba pool:
    column k - 1, the column the GDN op reads next ((num_computed - 1) // mamba_block_size)."""
    from vllm.v1.request import RequestStatus

    k, M = 3, layout.mamba_num_blocks
    sched, co = _ext_hit_scheduler(layout, ext_hit_config, k * BS, load_async)
    conn = sched.connector
    prompt = _rng_tokens(random.Random(11), 5 * BS + 3)
    sched.add_request(gl.make_request(layout, "a", prompt, max_tokens=2))
    free_m, free_a = co.mamba_block_pool.get_num_free_blocks(), co.attention_block_pool.get_num_free_blocks()

    so = sched.schedule()
    req = sched.requests["a"]
    assert conn.matched == [("a", 0)]  # no local hit: the connector is asked from token 0
    # Taken as reported (no mamba cap); a sync load's chunk (32 tokens) is already counted.
    assert req.num_computed_tokens == k * BS + (0 if load_async else 2 * BS)
    ((rid, n_ext, ids),) = conn.allocs
    assert (rid, n_ext) == ("a", k * BS) and ids == gl.block_table(sched, "a")
    m0, m1, m2, attn = ids
    assert m0 == m1 == m2  # mirrored mamba groups
    x = m0[k - 1]
    assert gl.state_block_column(k * BS, BS) == k - 1 == 2
    assert m0[:k - 1] == [0] * (k - 1) and 0 < x < M  # a state block at the hit's last column
    assert co.mamba_block_pool.blocks[x].ref_cnt == 3  # one compact-pool row, held by the 3 groups
    assert 0 not in attn and len(set(attn)) == len(attn)
    if load_async:
        assert so.num_scheduled_tokens == {} and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert m0 == [0, 0, x] and len(attn) == k  # only the hit's blocks
        assert co.mamba_block_pool.get_num_free_blocks() == free_m - 1
        assert co.attention_block_pool.get_num_free_blocks() == free_a - k
        assert co.mamba_block_pool.blocks[x].block_hash is None  # delay_cache_blocks: not cached yet
        _finish(sched, so, finished_recving={"a"})  # the worker reports the load done
        so = sched.schedule()  # _update_waiting_for_remote_kv: cache_blocks(request, 48); the request runs
        assert len(conn.allocs) == 2 and conn.allocs[1][:2] == ("a", 0)
    # Both: the remaining prompt, block-aligned (80), starts from the loaded state.
    assert so.num_scheduled_tokens == {"a": 5 * BS - k * BS}
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == k * BS
    m0, m1, m2, attn = new.block_ids
    y = m0[4]
    assert m0 == m1 == m2 == [0, 0, x, 0, y] and 0 < y < M and y != x
    assert len(attn) == 5 and list(attn[:k]) == ids[3][:k]
    # The GDN op reads column (48 - 1) // 16 = 2, block x (the loaded state), writes (80 - 1) // 16 = 4.
    read_col, write_col = gl.state_block_column(k * BS, BS), gl.state_block_column(5 * BS, BS)
    assert (read_col, write_col) == (2, 4) and m0[read_col] == x and m0[write_col] == y
    assert co.mamba_block_pool.get_num_free_blocks() == free_m - 2
    assert co.attention_block_pool.get_num_free_blocks() == free_a - 5
    # vLLM's default prefix_cache_retention_interval = 0 hashes only semantic mamba checkpoints (the
    # prompt's replay boundary, shared-prefix junctions): the loaded 48-token state gets no hash.
    assert co.retention_interval == 0 and co.mamba_block_pool.blocks[x].block_hash is None
    _drain(sched, so)


def test_unaligned_external_hit_is_not_capped(layout, ext_hit_config):
    """Neither vLLM's scheduler nor tpu-inference's coordinator aligns an external hit for the mamba
    groups: a 40-token (2.5 blocks) sync hit is taken as is; the state block goes to column
    (40 - 1) // 16 = 2 and the next chunk runs only to the block boundary (48), written in place."""
    sched, co = _ext_hit_scheduler(layout, ext_hit_config, 40, False)
    conn = sched.connector
    sched.add_request(gl.make_request(layout, "u", _rng_tokens(random.Random(12), 5 * BS + 3), max_tokens=2))
    so = sched.schedule()
    ((rid, n_ext, ids),) = conn.allocs
    (new,) = so.scheduled_new_reqs
    assert (rid, n_ext) == ("u", 40) and new.num_computed_tokens == 40  # taken as reported
    assert tuple(map(list, new.block_ids)) == ids
    assert so.num_scheduled_tokens == {"u": 8}  # _mamba_block_aligned_split: to the next boundary
    m0, m1, m2, attn = ids
    assert m0 == m1 == m2 and m0[:2] == [0, 0] and len(m0) == 3 and 0 < m0[2] < layout.mamba_num_blocks
    assert len(attn) == 3 and 0 not in attn
    assert gl.state_block_column(40, BS) == gl.state_block_column(48, BS) == 2  # read and write the same block
    _drain(sched, so)
