"""parse_config: kv_connector_extra_config validated key by key, TPU_OFFLOAD_* environment fallbacks."""

from __future__ import annotations

import re

import pytest

from tpuoffload.config import KNOWN_KEYS, OffloadConfig, parse_config

BASE = {"cpu_bytes_to_use": 1 << 30}
NO_ENV: dict[str, str] = {}


def parse(extra, environ=NO_ENV):
    return parse_config(extra, environ=environ)


# ---------------------------------------------------------------- good values
def test_defaults_with_only_host_ram():
    cfg = parse(BASE)
    assert cfg == OffloadConfig(cpu_bytes_to_use=1 << 30)
    assert cfg.lazy_offload is False and cfg.save_decode_blocks is False
    assert cfg.host_memory_kind == "pinned_host"
    assert cfg.host_bytes(4096) == 1 << 30
    assert cfg.staging_capacity(4096) == 256 * 4096  # num_staging_blocks default
    assert "cpu_bytes_to_use=1073741824" in cfg.summary()


def test_every_key_accepts_a_good_value():
    extra = {
        "cpu_bytes_to_use": 123456789, "num_cpu_chunks": 7, "lazy_offload": True, "staging_bytes": 1 << 20,
        "num_staging_blocks": 9, "save_threads": 3, "host_memory_kind": "unpinned_host",
        "save_decode_blocks": "yes", "load_wait_timeout_s": 2.5, "save_timeout_s": "30", "stats_dir": "/tmp/x",
        "stats_interval_s": 0, "transfer_buffer_bytes": 1 << 24, "num_hosts": 4,
        "persist_path": "/tmp/ckpt", "persist_interval_s": "600", "persist_timeout_s": 30,
        "disk_path": "/nvme/kv-{host}", "disk_bytes_to_use": 1 << 30, "state_ram_fraction": "0.4",
        "shared_url": "file:///mnt/lustre/kv?bytes=1000000",
    }
    assert set(extra) == set(KNOWN_KEYS)  # this test covers every key there is
    cfg = parse(extra)
    assert cfg.cpu_bytes_to_use == 123456789
    assert cfg.shared_url == "file:///mnt/lustre/kv?bytes=1000000"
    assert cfg.num_cpu_chunks is None  # explicit bytes win over chunks
    assert cfg.lazy_offload is True and cfg.save_decode_blocks is True
    assert cfg.staging_bytes == 1 << 20 and cfg.staging_capacity(4096) == 1 << 20
    assert cfg.num_staging_blocks == 9 and cfg.save_threads == 3
    assert cfg.host_memory_kind == "unpinned_host"
    assert cfg.load_wait_timeout_s == 2.5 and cfg.save_timeout_s == 30.0
    assert cfg.persist_path == "/tmp/ckpt" and cfg.persist_interval_s == 600.0 and cfg.persist_timeout_s == 30.0
    assert cfg.stats_dir == "/tmp/x" and cfg.stats_interval_s == 0.0
    assert cfg.transfer_buffer_bytes == 1 << 24 and cfg.num_hosts == 4
    assert cfg.state_ram_fraction == 0.4 and cfg.pool_bytes(4096, 2) == (123456789 - 49382715, 49382715)


def test_chunks_instead_of_bytes():
    cfg = parse({"num_cpu_chunks": "16"})
    assert cfg.cpu_bytes_to_use is None and cfg.num_cpu_chunks == 16
    assert cfg.host_bytes(4096) == 16 * 4096


@pytest.mark.parametrize("value,want", [(True, True), (False, False), (1, True), (0, False), ("on", True),
                                        ("OFF", False), (" true ", True), ("0", False)])
def test_boolean_spellings(value, want):
    assert parse({**BASE, "lazy_offload": value}).lazy_offload is want


def test_integral_floats_and_digit_strings_are_integers():
    cfg = parse({"cpu_bytes_to_use": 1e9, "save_threads": " 8 "})
    assert cfg.cpu_bytes_to_use == 10**9 and isinstance(cfg.cpu_bytes_to_use, int)
    assert cfg.save_threads == 8


def test_none_extra_config_needs_the_environment():
    with pytest.raises(ValueError, match="cpu_bytes_to_use.*num_cpu_chunks"):
        parse(None)
    assert parse(None, {"TPU_OFFLOAD_NUM_CPU_CHUNKS": "4"}).num_cpu_chunks == 4


# ---------------------------------------------------------------- environment fallbacks
ENV = {
    "TPU_OFFLOAD_NUM_CPU_CHUNKS": "64",
    "TPU_OFFLOAD_NUM_STAGING_BLOCKS": "32",
    "TPU_OFFLOAD_SAVE_THREADS": "2",
    "TPU_OFFLOAD_DECODE_SAVE": "1",
    "TPU_OFFLOAD_USE_UNPINNED_HOST": "true",
}


def test_environment_fallbacks():
    cfg = parse({}, ENV)
    assert cfg.num_cpu_chunks == 64 and cfg.cpu_bytes_to_use is None
    assert cfg.num_staging_blocks == 32 and cfg.save_threads == 2
    assert cfg.save_decode_blocks is True and cfg.host_memory_kind == "unpinned_host"
    assert parse({}, {**ENV, "TPU_OFFLOAD_USE_UNPINNED_HOST": "0"}).host_memory_kind == "pinned_host"


def test_explicit_keys_win_over_the_environment():
    cfg = parse({"num_cpu_chunks": 8, "num_staging_blocks": 4, "save_threads": 1, "save_decode_blocks": False,
                 "host_memory_kind": "pinned_host"}, ENV)
    assert (cfg.num_cpu_chunks, cfg.num_staging_blocks, cfg.save_threads) == (8, 4, 1)
    assert cfg.save_decode_blocks is False and cfg.host_memory_kind == "pinned_host"
    # explicit bytes win over chunks from the environment
    cfg = parse({"cpu_bytes_to_use": 1 << 20}, ENV)
    assert cfg.cpu_bytes_to_use == 1 << 20 and cfg.num_cpu_chunks is None
    # an explicit good value hides a bad environment value entirely
    assert parse({**BASE, "save_threads": 4}, {"TPU_OFFLOAD_SAVE_THREADS": "lots"}).save_threads == 4


def test_environment_is_read_from_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("TPU_OFFLOAD_SAVE_THREADS", "5")
    assert parse_config(BASE).save_threads == 5
    assert parse_config(BASE, environ={}).save_threads == 4  # an explicit environ replaces os.environ


@pytest.mark.parametrize("env,value,names", [
    ("TPU_OFFLOAD_NUM_CPU_CHUNKS", "0", "num_cpu_chunks"),
    ("TPU_OFFLOAD_NUM_CPU_CHUNKS", "-3", "num_cpu_chunks"),
    ("TPU_OFFLOAD_NUM_CPU_CHUNKS", "many", "num_cpu_chunks"),
    ("TPU_OFFLOAD_NUM_STAGING_BLOCKS", "0", "num_staging_blocks"),
    ("TPU_OFFLOAD_SAVE_THREADS", "100000", "save_threads"),
    ("TPU_OFFLOAD_DECODE_SAVE", "perhaps", "save_decode_blocks"),
    ("TPU_OFFLOAD_USE_UNPINNED_HOST", "2", "TPU_OFFLOAD_USE_UNPINNED_HOST"),
])
def test_bad_environment_values_name_the_setting(env, value, names):
    with pytest.raises(ValueError, match=re.escape(names)):
        parse(BASE, {env: value})


# ---------------------------------------------------------------- bad values
BAD = [
    ("cpu_bytes_to_use", 0), ("cpu_bytes_to_use", -1), ("cpu_bytes_to_use", 1 << 62), ("cpu_bytes_to_use", "lots"),
    ("cpu_bytes_to_use", 1.5), ("cpu_bytes_to_use", True), ("cpu_bytes_to_use", [1]),
    ("num_cpu_chunks", 0), ("num_cpu_chunks", -5), ("num_cpu_chunks", 1 << 40), ("num_cpu_chunks", "x"),
    ("staging_bytes", 0), ("staging_bytes", -1), ("staging_bytes", 1 << 62), ("staging_bytes", 2.5),
    ("num_staging_blocks", 0), ("num_staging_blocks", -1), ("num_staging_blocks", 1 << 30),
    ("num_staging_blocks", None), ("num_staging_blocks", "ten"),
    ("save_threads", 0), ("save_threads", -2), ("save_threads", 10_000), ("save_threads", False),
    ("save_threads", 2.5),
    ("lazy_offload", "maybe"), ("lazy_offload", 2), ("lazy_offload", None), ("lazy_offload", 0.5),
    ("save_decode_blocks", "sometimes"), ("save_decode_blocks", -1),
    ("host_memory_kind", "device"), ("host_memory_kind", ""), ("host_memory_kind", None), ("host_memory_kind", 1),
    ("load_wait_timeout_s", 0), ("load_wait_timeout_s", -1), ("load_wait_timeout_s", 1e9),
    ("load_wait_timeout_s", "soon"), ("load_wait_timeout_s", True), ("load_wait_timeout_s", float("nan")),
    ("save_timeout_s", 0), ("save_timeout_s", -0.5), ("save_timeout_s", float("inf")), ("save_timeout_s", None),
    ("stats_interval_s", -1), ("stats_interval_s", 1e7), ("stats_interval_s", "often"),
    ("stats_dir", ""), ("stats_dir", 5), ("stats_dir", ["/tmp"]),
    ("transfer_buffer_bytes", 0), ("transfer_buffer_bytes", -1), ("transfer_buffer_bytes", "big"),
    ("num_hosts", 0), ("num_hosts", -1), ("num_hosts", 1 << 20), ("num_hosts", 1.5), ("num_hosts", "two"),
    ("num_hosts", True),
    ("persist_path", ""), ("persist_path", 3), ("persist_interval_s", -1), ("persist_interval_s", "hourly"),
    ("persist_timeout_s", 0), ("persist_timeout_s", "long"),
    ("disk_path", ""), ("disk_path", 7), ("disk_bytes_to_use", 0), ("disk_bytes_to_use", "lots"),
    ("shared_url", ""), ("shared_url", 7), ("shared_url", "s3://b/kv"), ("shared_url", "file://host/kv"),
    ("shared_url", "redis://kv:6379?bytes=5"),
    ("state_ram_fraction", 0), ("state_ram_fraction", 1), ("state_ram_fraction", 1.5), ("state_ram_fraction", -0.1),
    ("state_ram_fraction", "half"), ("state_ram_fraction", True),
]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_bad_values_raise_naming_the_key(key, value):
    with pytest.raises(ValueError, match=re.escape(repr(key))):
        parse({**BASE, key: value} if key != "cpu_bytes_to_use" else {key: value})


def test_every_key_has_a_bad_value_case():
    assert {k for k, _ in BAD} == set(KNOWN_KEYS)


def test_unknown_keys_are_rejected_listing_the_known_ones():
    with pytest.raises(ValueError) as e:
        parse({**BASE, "cpu_byte_to_use": 1, "lazy": True})
    msg = str(e.value)
    assert "cpu_byte_to_use" in msg and "'lazy'" in msg
    for key in KNOWN_KEYS:
        assert key in msg


def test_host_ram_must_be_set():
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        parse({"lazy_offload": True})
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        parse({"cpu_bytes_to_use": None})


# ---------------------------------------------------------------- through vLLM
@pytest.mark.parametrize("extra,key", [
    ({"cpu_bytes_to_use": 1 << 22, "lazy_offload": "maybe"}, "lazy_offload"),
    ({"cpu_bytes_to_use": 0}, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": 1 << 22, "save_thread": 4}, "save_thread"),
])
def test_bad_extra_config_fails_connector_construction(extra, key):
    from tpuoffload.sim.vllm_setup import make_scheduler

    with pytest.raises(ValueError, match=re.escape(key)):
        make_scheduler(num_blocks=16, block_size=16, kv_connector_extra_config=extra)


def test_good_extra_config_reaches_the_connector():
    from tpuoffload.sim.vllm_setup import make_scheduler

    sched = make_scheduler(num_blocks=16, block_size=16, kv_connector_extra_config={
        "cpu_bytes_to_use": 1 << 20, "lazy_offload": "true", "save_timeout_s": 7})
    cfg = sched.connector.config
    assert cfg.cpu_bytes_to_use == 1 << 20 and cfg.lazy_offload is True and cfg.save_timeout_s == 7.0
    off = sched.connector.scheduler
    assert off.index.num_slots == (1 << 20) // off.chunk_bytes
    assert off.num_hosts == 1 and sched.connector.get_finished_count() == 1


def test_num_hosts_overrides_the_detected_reporting_workers():
    """A mesh-wide page of 8 KV heads over 4 ranks with vLLM's default executor: 4 reporting
    workers, each holding a quarter (the page of 2 heads); num_hosts=2 says 2 processes report,
    each holding half."""
    from tpuoffload.sim.vllm_setup import make_scheduler

    page = make_scheduler(num_blocks=16, block_size=16, kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20},
                          tensor_parallel_size=1).connector.scheduler.chunk_bytes
    four = make_scheduler(num_blocks=16, block_size=16, kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20},
                          tensor_parallel_size=4, num_kv_heads=8)
    assert four.connector.get_finished_count() == 4 and four.connector.scheduler.chunk_bytes == page
    two = make_scheduler(num_blocks=16, block_size=16, tensor_parallel_size=4, num_kv_heads=8,
                         kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20, "num_hosts": 2})
    assert two.connector.get_finished_count() == 2 and two.connector.scheduler.num_hosts == 2
    assert two.connector.scheduler.chunk_bytes == 2 * page


def test_persist_interval_needs_persist_path():
    with pytest.raises(ValueError, match="needs 'persist_path'"):
        parse({**BASE, "persist_interval_s": 60})
    assert parse({**BASE, "persist_path": "/x", "persist_interval_s": 60}).persist_interval_s == 60.0


def test_disk_path_and_bytes_go_together():
    with pytest.raises(ValueError, match="go together"):
        parse({**BASE, "disk_path": "/d"})
    with pytest.raises(ValueError, match="go together"):
        parse({**BASE, "disk_bytes_to_use": 1 << 20})


def test_separate_dp_engines_keep_their_files_apart():
    """``vllm serve --data-parallel-size 2`` on tpu-inference (TPU_MULTIPROCESS_DP=1): two engines share
    each host; their stats snapshots, checkpoints and chunk files must never be the same files."""
    import types

    from tpuoffload.config import per_engine

    config = parse_config({"cpu_bytes_to_use": 1 << 22, "stats_dir": "/s", "persist_path": "/p",
                           "disk_path": "/d/{host}", "disk_bytes_to_use": 1 << 24})
    engines = [per_engine(config, types.SimpleNamespace(data_parallel_size=2, data_parallel_index=i)) for i in (0, 1)]
    for key in ("stats_dir", "persist_path", "disk_path"):
        paths = [getattr(e, key) for e in engines]
        assert len(set(paths)) == 2 and all(p.startswith(getattr(config, key)) for p in paths), paths
    assert engines[1].disk_path == "/d/{host}/engine-dp1"
    one = per_engine(config, types.SimpleNamespace(data_parallel_size=1, data_parallel_index=0))
    assert one == config  # one engine: the paths as given


def test_dense_dp_engines_keep_their_files_apart_after_vllm_rewrites_their_parallel_config():
    """The path ``vllm serve --data-parallel-size 2`` really takes for a dense model: vLLM's engine
    process sets ``data_parallel_index`` and then rewrites its own ParallelConfig as DP 1
    (``reconfigure_for_independent_dp_rank``, vLLM 0.32 ``run_engine_core``), so the engines' sizes
    say 1. Their files must still differ (the serving stack's shape (d) found both engines writing
    ``host-0.json`` and ``scheduler.json`` into one directory when only the size was read)."""
    from vllm.config import ParallelConfig

    from tpuoffload.config import per_engine

    config = parse_config({"cpu_bytes_to_use": 1 << 22, "stats_dir": "/s", "persist_path": "/p",
                           "disk_path": "/d/{host}", "disk_bytes_to_use": 1 << 24})
    engines = []
    for i in (0, 1):
        pc = ParallelConfig(data_parallel_size=2)
        pc.data_parallel_index = i  # as vLLM's engine process does, before the rewrite
        pc.reconfigure_for_independent_dp_rank()
        assert pc.data_parallel_size == 1 and pc.data_parallel_rank == 0
        engines.append(per_engine(config, pc))
    for key in ("stats_dir", "persist_path", "disk_path"):
        assert getattr(engines[0], key) != getattr(engines[1], key), key
    assert engines[0] == config and engines[1].stats_dir == "/s/engine-dp1"


def test_multiprocess_dp_engines_are_single_scheduler_engines_with_their_own_files(monkeypatch):
    """``TPU_MULTIPROCESS_DP=1``: tpu-inference's own sharding config gives each engine a mesh without
    DP (``total_dp_size`` 1) while vLLM's parallel config keeps the engine's DP index, so each
    engine's connector is one plain scheduler (no DPScheduler) whose files stay its own."""
    import types

    from vllm.v1.core.sched.scheduler import Scheduler

    from tpuoffload.config import per_engine
    from tpuoffload.manager.topology import DPRank
    from tpuoffload.sim.tpu_layouts import tpu_inference

    sharding = tpu_inference().sharding
    monkeypatch.setenv("TPU_MULTIPROCESS_DP", "1")
    config = parse_config({"cpu_bytes_to_use": 1 << 22, "stats_dir": "/s"})
    for index in (0, 1):
        parallel = types.SimpleNamespace(tensor_parallel_size=4, data_parallel_size=2, data_parallel_rank=index,
                                         data_parallel_index=index, data_parallel_size_local=1,
                                         decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                         enable_expert_parallel=False, pipeline_parallel_size=1)
        vllm_config = types.SimpleNamespace(additional_config={}, parallel_config=parallel, lora_config=None,
                                            model_config=types.SimpleNamespace(use_mla=False),
                                            scheduler_config=types.SimpleNamespace(scheduler_cls=Scheduler))
        vllm_config.sharding_config = sharding.ShardingConfigManager.from_vllm_config(vllm_config)
        assert vllm_config.sharding_config.total_dp_size == 1 and parallel.data_parallel_size == 2
        assert DPRank.of(vllm_config, types.SimpleNamespace(num_blocks=48)) == DPRank()
        assert per_engine(config, parallel).stats_dir == f"/s/engine-dp{index}"


def test_shared_url_is_validated():
    with pytest.raises(ValueError, match="unknown scheme 'gs'"):
        parse({**BASE, "shared_url": "gs://bucket/kv"})
    with pytest.raises(ValueError, match="low .* must be below high"):
        parse({**BASE, "shared_url": "file:///kv?high=0.5&low=0.6"})
