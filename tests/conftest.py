import os

# Must run before jax is imported anywhere: several CPU devices for the sharded-cache tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# vLLM's optional ``humming`` kernels, once imported (GDN layers do), start two background Python
# processes in every importing process to build their CUDA launcher and NVRTC binary; nothing here
# has CUDA, and on two cores they compete with the tests. The package's own switch turns that off
# (inherited by every process the tests start: pod-slice workers, servers, Ray nodes).
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")



# ---- order: the longest files first ----
# scripts/test.sh runs the suite on two workers, each test file whole on one (``--dist loadfile``),
# in collection order: a long file collected last would start last and set the suite's end.
LONGEST_FIRST = ("test_serve_stack.py", "test_real_engine.py", "test_real_engine_hazard.py", "test_dp_scheduler.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every other file keeps its order


# ---- pod slices (tpuoffload.sim.podslice): shared by test_podslice.py and test_warm_restart.py ----
import pytest  # noqa: E402


def assert_gone(procs) -> None:
    """Every worker process, and its whole process group, is gone."""
    assert procs, "no worker processes were recorded"
    for proc in procs:
        assert proc.poll() is not None, f"worker {proc.pid} still running"
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)


@pytest.fixture
def make_slice(tmp_path):
    """Build PodSlices whose logs go to tmp_path; after the test every worker must be gone."""
    from tpuoffload.sim.podslice import PodSlice

    pods = []

    def make(spec, chaos=None, **kw):
        pod = PodSlice(spec, chaos, log_dir=str(tmp_path / f"slice{len(pods)}"), **kw)
        pods.append(pod)
        return pod

    yield make
    for pod in pods:
        pod.close()
    for pod in pods:
        assert_gone(pod.procs)


# ---- transfer engines: shared by tests/test_engine_*.py (helpers in engine_helpers.py) ----
@pytest.fixture
def engines():
    """``make(caches, slots=NUM_SLOTS, **kw)`` builds a TransferEngine over ``caches`` with room
    for ``slots`` chunks in each batch shard (the spare rows of several shards added); after the
    test each is drained and closed."""
    from engine_helpers import NUM_SLOTS
    from tpuoffload.layout import CacheLayout
    from tpuoffload.backend.slot_table import SHARD_SPARE_ROWS
    from tpuoffload.worker.transfer_engine import TransferEngine

    made = []

    def make(caches, *, slots=NUM_SLOTS, **kw):
        layout = CacheLayout.from_caches(caches)
        rows = slots + (SHARD_SPARE_ROWS if layout.groups[0].num_shards > 1 else 0)
        eng = TransferEngine(caches, rows * layout.device_bytes_per_chunk, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.wait_idle(10)
        eng.close()


@pytest.fixture
def load_program_shape(monkeypatch):
    """(tests/test_engine_*.py) Rebuild the programs with the load split into parts / read by loops (module constants)."""
    from tpuoffload.worker import programs

    def set_(**consts):
        for k, v in consts.items():
            monkeypatch.setattr(programs, k, v)
        programs.programs_for.cache_clear()

    yield set_
    monkeypatch.undo()
    programs.programs_for.cache_clear()  # no program built with patched constants outlives the test


# ---- one-process engines (tpuoffload.sim.engine): shared by test_disk_wiring.py and test_shared_tier.py ----
def assert_engine_clean(engine) -> None:
    """No wrong KV byte was read, nothing leaked in the scheduler half and every host is idle."""
    assert engine.mismatches() == 0
    leaks = {k: v for k, v in engine.offload.leak_report().items() if v}
    assert not leaks, leaks
    for host, conn in enumerate(engine.connectors):
        busy = {k: v for k, v in conn.worker.idle_report().items() if v}
        assert not busy, (host, busy)


@pytest.fixture(params=["file", "redis"])
def shared_url(request, tmp_path):
    """A shared-tier URL of each backend: a directory, or a Redis server of its own for the test."""
    if request.param == "file":
        yield f"file://{tmp_path}/shared?timeout_s=30"
    else:
        from tpuoffload.sim.redis_server import RedisServer

        with RedisServer() as server:
            yield f"{server.url}?timeout_s=30"
