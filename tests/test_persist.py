"""Warm-restart checkpoints through orbax: byte-exact round trips on one and on two JAX processes,
and every bad checkpoint (foreign fingerprint, partial, truncated, flipped byte, a host killed
while writing) is refused with its reason, on every host, never restored as garbage.
(tools/bench_storage.py measures a checkpoint's write and restore speed.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tpuoffload.persist import Fingerprint, Persister, RequestWatcher, read_index, request_checkpoint
from tpuoffload.persist.checkpoint import decode_index, encode_index
from tpuoffload.persist.request import DONE_NAME, REQUEST_NAME, main as request_main, read_done, wait_done

# When one array read fails (a truncated or missing data file), orbax abandons its other read
# coroutines; Python reports them as unraisable when they are collected, in whichever test runs then.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SLOTS, SLOT_BYTES = 24, 8192
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def fingerprint(num_hosts: int = 1, **changes) -> Fingerprint:
    fields = dict(model="tiny-llama", kv_layout="rpa5d(l=2,bs=16,h=8,d=128)/model", kv_dtype="bfloat16",
                  block_size=16, num_hosts=num_hosts, chunk_bytes=SLOT_BYTES)
    fields.update(changes)
    return Fingerprint(**fields)


def host_slots(host: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic storage and tags of one host: every tagged slot starts with a marker that
    names (host, slot) so a test can find its bytes inside orbax's data files."""
    rng = np.random.default_rng(1000 * seed + host)
    storage = rng.integers(0, 256, (SLOTS, SLOT_BYTES), dtype=np.uint8)
    tags = np.arange(100 * host + 5, 100 * host + 5 + SLOTS, dtype=np.int64)
    tags[[3, 7]] = -1  # empty slots
    tags[11] = 1 << 40  # save ids beyond 32 bits survive
    for s in range(SLOTS):
        storage[s, :16] = np.frombuffer(f"MARK-h{host}-s{s:04d}-".encode()[:16].ljust(16, b"."), np.uint8)
    return storage, tags


INDEX = {"hashes": [b"\x00\x01" * 16, b"\xff" * 32], "save_ids": [5, 6], "lru": [1, 0], "next_save_id": 7,
         "nested": {"t": (1, 2)}}


def _restore(path: str, fp: Fingerprint, slots: int = SLOTS, **kw):
    p = Persister(path, fp, **kw)
    into = np.full((slots, fp.chunk_bytes), 0xAB, np.uint8)
    restored, reason = p.restore(into)
    p.close()
    return restored, reason, into


def _save(path: str, fp: Fingerprint, storage, tags, index=INDEX, **kw):
    p = Persister(path, fp, **kw)
    p.restore(np.zeros_like(storage))  # start-up: picks the checkpoint number
    report = p.save(storage, tags, index).result(timeout=120)
    p.close()
    return report


def _assert_exact(into, tags_got, storage, tags):
    assert np.array_equal(tags_got, tags)
    tagged = tags != -1
    assert np.array_equal(into[tagged], storage[tagged])


# ---------------------------------------------------------------- one process
def test_index_encoding_round_trip():
    enc = encode_index(INDEX)
    assert json.loads(json.dumps(enc)) == enc
    assert decode_index(enc) == {**INDEX, "nested": {"t": [1, 2]}}
    with pytest.raises(TypeError):
        encode_index({"x": object()})


def test_round_trip_numbering_and_pruning(tmp_path, caplog):
    path = str(tmp_path / "persist")
    storage, tags = host_slots(0)
    fp = fingerprint()
    reports = []
    p = Persister(path, fp, keep=2)
    restored, reason = p.restore(np.zeros_like(storage))
    assert restored is None and "no complete checkpoint" in reason
    for i in range(3):
        storage[5, 100] = i  # each checkpoint is of the state at its save
        reports.append(p.save(storage, tags, {**INDEX, "i": i}).result(timeout=120))
    p.close()
    assert p.counters_snapshot() == {"persist_restore_refused": 1, "persist_saved_chunks": 3 * (SLOTS - 2),
                                     "persist_saved_bytes": 3 * (SLOTS - 2) * SLOT_BYTES}
    assert [(r.ok, r.seq) for r in reports] == [(True, 1), (True, 2), (True, 3)]
    assert reports[0].chunks == SLOTS - 2 and reports[0].bytes == (SLOTS - 2) * SLOT_BYTES
    assert sorted(os.listdir(path)) == ["ckpt-2", "ckpt-3"]  # keep=2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tpuoffload.persist"):
        restored, reason, into = _restore(path, fp)
    assert reason == "" and restored.seq == 3 and restored.index["i"] == 2
    assert read_index(path, 3, fingerprint())[0] == restored.index
    assert "block_size" in read_index(path, 3, fingerprint(block_size=32))[1]
    assert read_index(path, 1, fingerprint())[0] is None  # pruned
    assert restored.index["hashes"] == INDEX["hashes"]
    assert restored.chunks == SLOTS - 2
    _assert_exact(into, restored.tags, storage, tags)
    assert len([r for r in caplog.records if r.name == "tpuoffload.persist"]) == 1


def _refused(path, fp, caplog, slots=SLOTS):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tpuoffload.persist"):
        restored, reason, into = _restore(path, fp, slots=slots)
    lines = [r for r in caplog.records if r.name == "tpuoffload.persist"]
    assert restored is None and reason
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and reason in lines[0].getMessage()
    return reason


@pytest.mark.parametrize("field, value", [("model", "other-model"), ("kv_layout", "mla4d"),
                                          ("kv_dtype", "float8_e4m3fn"), ("block_size", 32), ("format_version", 2)])
def test_fingerprint_mismatch_refused(tmp_path, caplog, field, value):
    path = str(tmp_path / "p")
    storage, tags = host_slots(0)
    assert _save(path, fingerprint(), storage, tags).ok
    reason = _refused(path, fingerprint(**{field: value}), caplog)
    assert "fingerprint mismatch" in reason and f"{field}: checkpoint" in reason


def test_host_ram_size_change_refused(tmp_path, caplog):
    path = str(tmp_path / "p")
    storage, tags = host_slots(0)
    assert _save(path, fingerprint(), storage, tags).ok
    assert "cpu_bytes_to_use changed" in _refused(path, fingerprint(), caplog, slots=SLOTS - 1)


def _data_file_with(root: str, needle: bytes) -> tuple[str, int]:
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                data = f.read()
            at = data.find(needle)
            if at >= 0:
                return full, at
    raise AssertionError(f"{needle!r} not found under {root}")


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def test_flipped_byte_in_slot_data_refused(tmp_path, caplog):
    path = str(tmp_path / "p")
    storage, tags = host_slots(0)
    assert _save(path, fingerprint(), storage, tags).ok
    data_file, at = _data_file_with(path, b"MARK-h0-s0009-")
    _flip(data_file, at + 600)  # inside slot 9's payload
    reason = _refused(path, fingerprint(), caplog)
    assert "fail their checksum" in reason and "slot 9" in reason


@pytest.mark.parametrize("item, needle", [("meta", b'"block_size"'), ("index", b'"save_ids"')])
def test_flipped_byte_in_meta_or_index_refused(tmp_path, caplog, item, needle):
    path = str(tmp_path / "p")
    storage, tags = host_slots(0)
    assert _save(path, fingerprint(), storage, tags).ok
    f = os.path.join(path, "ckpt-1", item, "metadata")
    with open(f, "rb") as fh:
        at = fh.read().find(needle)
    assert read_index(path, 1, fingerprint())[0] is not None  # (before the damage below)
    _flip(f, at + 3)
    reason = _refused(path, fingerprint(), caplog)
    assert "unreadable" in reason or "mismatch" in reason
    index, why = read_index(path, 1, fingerprint())  # the scheduler's own read refuses it too
    assert index is None and ("unreadable" in why or "mismatch" in why)


def test_truncated_or_missing_data_refused(tmp_path, caplog):
    path = str(tmp_path / "p")
    storage, tags = host_slots(0)
    assert _save(path, fingerprint(), storage, tags).ok
    data_file, _ = _data_file_with(path, b"MARK-h0-s0009-")
    os.truncate(data_file, os.path.getsize(data_file) // 2)
    assert "unreadable slots" in _refused(path, fingerprint(), caplog)
    os.unlink(data_file)
    assert "unreadable slots" in _refused(path, fingerprint(), caplog)
    shutil.rmtree(os.path.join(path, "ckpt-1", "index"))
    assert "unreadable index" in _refused(path, fingerprint(), caplog)


def test_partial_checkpoint_is_never_restored(tmp_path, caplog):
    path = str(tmp_path / "p")
    storage, tags = host_slots(0)
    assert _save(path, fingerprint(), storage, tags).ok
    storage2, tags2 = host_slots(0, seed=1)
    assert _save(path, fingerprint(), storage2, tags2).ok
    # checkpoint 2 as a host crash leaves it: never renamed into place
    os.rename(os.path.join(path, "ckpt-2"), os.path.join(path, "ckpt-2.orbax-checkpoint-tmp"))
    restored, reason, into = _restore(path, fingerprint())
    assert restored.seq == 1 and restored.ignored_partial == ("ckpt-2.orbax-checkpoint-tmp",)
    _assert_exact(into, restored.tags, storage, tags)
    # the next save numbers past the partial one and prunes it
    p = Persister(path, fingerprint(), keep=1)
    p.restore(np.zeros_like(storage))
    assert p.next_seq == 3
    assert p.save(storage2, tags2, INDEX).result(timeout=120).ok
    p.close()
    assert sorted(os.listdir(path)) == ["ckpt-3"]
    # only a partial one left: cold, and the reason says what was ignored
    os.rename(os.path.join(path, "ckpt-3"), os.path.join(path, "ckpt-3.orbax-checkpoint-tmp"))
    reason = _refused(path, fingerprint(), caplog)
    assert "no complete checkpoint" in reason and "ckpt-3.orbax-checkpoint-tmp" in reason


def test_unusable_path_is_a_cold_start_not_a_crash(tmp_path, caplog):
    f = tmp_path / "a_file"
    f.write_text("not a directory")
    assert "cannot list" in _refused(str(f), fingerprint(), caplog)
    p = Persister(str(f), fingerprint())
    storage, tags = host_slots(0)
    assert p.restore(np.zeros_like(storage))[0] is None
    report = p.save(storage, tags, INDEX).result(timeout=60)  # no number picked: refused, not raised
    assert not report.ok and "no checkpoint number" in report.reason


# ---------------------------------------------------------------- slots kept in global jax.Arrays
def store_specs(num_slots: int = SLOTS, layers: int = 2):
    """Two stores shaped like the engine's ((shards, slots, layers, ...), slot axis 1) on a mesh of
    every device: one split over both mesh axes, one replicated over 'data' (replica shards)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(2, -1)
    mesh = Mesh(devices, ("data", "model"))
    kind = "pinned_host"
    a = jax.ShapeDtypeStruct((2, num_slots, layers, 4, 8 * devices.shape[1]), np.uint16,
                             sharding=NamedSharding(mesh, P("data", None, None, None, "model"), memory_kind=kind))
    b = jax.ShapeDtypeStruct((1, num_slots, 3, 8 * devices.shape[1]), np.uint32,
                             sharding=NamedSharding(mesh, P(None, None, None, "model"), memory_kind=kind))
    return {"group0": a, "group1": b}


def store_values(spec, seed: int = 0) -> np.ndarray:
    n = int(np.prod(spec.shape))
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed) % np.iinfo(spec.dtype).max).astype(spec.dtype) \
        .reshape(spec.shape)


def make_stores(specs, seed: int = 0) -> dict:
    """Global arrays holding ``store_values``, each process filling only its own shards."""
    import jax

    return {name: jax.make_array_from_callback(sp.shape, sp.sharding, lambda idx, sp=sp: store_values(sp, seed)[idx])
            for name, sp in specs.items()}


def stores_match(stores: dict, specs, seed: int = 0) -> bool:
    """Every local shard of every restored store holds the expected values, in host memory."""
    for name, sp in specs.items():
        arr = stores[name]
        if arr.shape != sp.shape or arr.dtype != sp.dtype or arr.sharding.memory_kind != sp.sharding.memory_kind:
            return False
        want = store_values(sp, seed)
        for shard in arr.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), want[shard.index]):
                return False
    return True


def test_stores_round_trip_and_refusals(tmp_path, caplog):
    path = str(tmp_path / "p")
    specs = store_specs()
    stores = make_stores(specs)
    _, save_ids = host_slots(0)
    tags = np.stack([save_ids, 1000 + 3 * np.arange(SLOTS)], axis=1)  # a slot table: save id, source block
    p = Persister(path, fingerprint())
    assert p.restore(specs)[0] is None
    report = p.save(stores, tags, INDEX).result(timeout=120)
    p.close()
    assert report.ok and report.chunks == SLOTS - 2
    per_slot = sum(int(np.prod(sp.shape)) // SLOTS * np.dtype(sp.dtype).itemsize * (2 if name == "group1" else 1)
                   for name, sp in specs.items())  # group1 is replicated over 'data': two copies here
    assert report.bytes == (SLOTS - 2) * per_slot
    p = Persister(path, fingerprint())
    restored, reason = p.restore(specs)
    p.close()
    assert reason == "" and np.array_equal(restored.tags, tags) and stores_match(restored.stores, specs)
    assert restored.index["hashes"] == INDEX["hashes"]
    # another layout of the stores (one more layer): refused before any array is read
    p = Persister(path, fingerprint())
    restored, reason = p.restore(store_specs(layers=3))
    p.close()
    assert restored is None and "slot layout" in reason
    # a flipped byte in one store's data: refused
    want = store_values(specs["group0"])[0, 9, 0, 0, :8].tobytes()  # 16 bytes inside one shard
    data_file, at = _data_file_with(path, want)
    _flip(data_file, at + 10)
    p = Persister(path, fingerprint())
    restored, reason = p.restore(specs)
    p.close()
    assert restored is None and "fail their checksum (first: slot 9)" in reason


# ---------------------------------------------------------------- operator requests
def test_request_file_workflow(tmp_path, capsys):
    d = str(tmp_path / "persist")
    now = [0.0]
    w = RequestWatcher(d, poll_interval_s=1.0, clock=lambda: now[0])
    assert w.poll() is None  # no directory yet: no request, no error
    req = request_checkpoint(d)
    now[0] = 0.5
    assert w.poll() is None  # between polls: not even a stat
    now[0] = 1.0
    got = w.poll()
    assert got == req
    now[0] = 2.0
    assert w.poll() is None  # served once
    w.complete(got, True, 7)
    assert not os.path.exists(os.path.join(d, REQUEST_NAME))
    assert read_done(d).id == req.id and read_done(d).seq == 7 and read_done(d).ok
    assert wait_done(d, req.id, 0.1).ok
    # a plain `touch` is a request too
    open(os.path.join(d, REQUEST_NAME), "w").close()
    now[0] = 3.0
    touched = w.poll()
    assert touched is not None and touched.id.startswith("file-")
    w.complete(touched, False, None, "host 1 did not answer")
    # the CLI: exit 1 when the engine reports a failure, 2 when nobody answers
    assert request_main([d, "--wait", "0.3"]) == 2
    assert "no answer" in capsys.readouterr().err


def test_cli_module_entry_point(tmp_path):
    d = str(tmp_path / "p")
    out = subprocess.run([sys.executable, "-m", "tpuoffload.persist", "checkpoint", d], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "requested checkpoint" in out.stdout
    assert os.path.exists(os.path.join(d, REQUEST_NAME)) and not os.path.exists(os.path.join(d, DONE_NAME))


# ---------------------------------------------------------------- two JAX processes
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_hosts(mode: str, path: str, num_hosts: int = 2, timeout: float = 180.0, seed: int = 0,
               devices_per_host: int = 1) -> list[dict | None]:
    """Start ``num_hosts`` JAX processes running ``_host_main`` and return each one's JSON report
    (None for a host that printed none: killed). Every process runs in its own process group and
    every group is SIGKILLed on the way out, whatever happens."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_host}"
    procs = []
    try:
        for rank in range(num_hosts):
            procs.append(subprocess.Popen(
                [sys.executable, HERE, "--host", str(rank), str(num_hosts), str(port), path, mode, str(seed)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
        deadline = time.monotonic() + timeout
        outs = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{mode}: a host did not finish within {timeout} s") from None
            outs.append((proc.returncode, out.decode(), err.decode()))
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=10)
    reports = []
    for rank, (rc, out, err) in enumerate(outs):
        lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
        if not lines:
            reports.append(None)
            continue
        report = json.loads(lines[-1][len("REPORT "):])
        report["rc"], report["log"] = rc, err[-3000:]
        reports.append(report)
    return reports


@pytest.mark.slow
def test_two_hosts_write_and_restore_byte_exact(tmp_path):
    path = str(tmp_path / "p")
    written = _run_hosts("save", path)
    assert all(r is not None and r["save_ok"] for r in written), written
    assert [r["cold_reason"].startswith("no complete checkpoint") for r in written] == [True, True]
    assert os.listdir(path) == ["ckpt-1"]
    assert {d for d in os.listdir(os.path.join(path, "ckpt-1", "slots")) if d.startswith("ocdbt.process_")} == \
        {"ocdbt.process_0", "ocdbt.process_1"}  # each host wrote its own part
    restored = _run_hosts("restore", path)
    for host, r in enumerate(restored):
        assert r is not None and r["restored_seq"] == 1 and r["exact"] and r["index_ok"], (host, r)
        assert r["chunks"] == SLOTS - 2
    # one host's bytes damaged: every host refuses, naming that host
    data_file, at = _data_file_with(os.path.join(path, "ckpt-1", "slots", "ocdbt.process_1"), b"MARK-h1-s0004-")
    _flip(data_file, at + 100)
    refused = _run_hosts("restore", path)
    for r in refused:
        assert r is not None and r["restored_seq"] is None, r
        assert r["reason"].startswith(f"{path}/ckpt-1: host 1: 1 slot(s) fail their checksum"), r["reason"]
    # a checkpoint of 2 hosts into a 1-host deployment: refused by fingerprint
    restored, reason, _ = _restore(path, fingerprint(num_hosts=1))
    assert restored is None and "num_hosts: checkpoint 2, this deployment 1" in reason


@pytest.mark.slow
def test_two_hosts_stores_round_trip(tmp_path):
    """The engine's form: global store arrays in pinned host memory, sharded over both hosts (one
    store split by host, one replicated on both), saved as they are and restored onto the same
    sharding; every host checks its own shards."""
    path = str(tmp_path / "p")
    written = _run_hosts("save_stores", path, devices_per_host=2)
    assert all(r is not None and r["save_ok"] for r in written), written
    restored = _run_hosts("restore_stores", path, devices_per_host=2)
    for host, r in enumerate(restored):
        assert r is not None and r["restored_seq"] == 1 and r["exact"] and r["index_ok"], (host, r)


@pytest.mark.slow
def test_host_killed_during_checkpoint_next_start_is_cold(tmp_path):
    path = str(tmp_path / "p")
    killed = _run_hosts("save_kill", path)
    assert killed[1] is None  # host 1 died right after starting its part of the checkpoint
    assert killed[0] is None or not killed[0]["save_ok"], killed[0]  # host 0 never saw it commit
    assert "ckpt-1" not in os.listdir(path)
    restored = _run_hosts("restore", path)
    for r in restored:
        assert r is not None and r["restored_seq"] is None, r
        assert r["reason"].startswith(f"no complete checkpoint in {path}") and "ignored partial: ckpt-1" in r["reason"]
        assert r["all_empty"]  # the cold start uses nothing of the partial checkpoint


def _host_main(rank: int, num_hosts: int, port: int, path: str, mode: str, seed: int) -> None:
    """One host of the two-process tests: prints ``REPORT {json}``, meets the others at a barrier
    (bounded: a killed peer never comes) and exits without jax.distributed's shutdown."""
    import jax

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_hosts, rank, initialization_timeout=60,
                               heartbeat_timeout_seconds=30, shutdown_timeout_seconds=5)
    from tpuoffload.persist import PersistFaults

    class KillHost1(PersistFaults):
        def after_save_started(self, seq: int) -> None:
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    fp = fingerprint(num_hosts)
    storage, tags = host_slots(rank, seed)
    report: dict = {"host": rank}
    if mode.endswith("_stores"):
        specs = store_specs()
        p = Persister(path, fp, barrier_timeout_s=90)
        restored, reason = p.restore(specs)
        if mode == "save_stores":
            r = p.save(make_stores(specs, seed), tags, INDEX).result(timeout=120)
            report.update(save_ok=r.ok, save_reason=r.reason)
        else:
            report.update(restored_seq=None if restored is None else restored.seq, reason=reason)
            if restored is not None:
                exact = np.array_equal(restored.tags, tags) and stores_match(restored.stores, specs, seed)
                report.update(exact=bool(exact),
                              index_ok=restored.index == {**INDEX, "nested": {"t": [1, 2]}})
        _report_and_exit(report)
    # A short commit timeout where a host is killed (host 0 gives up on it quickly); a long one
    # elsewhere, so that a loaded test machine never times out a healthy checkpoint.
    p = Persister(path, fp, barrier_timeout_s=8 if mode == "save_kill" else 90,
                  faults=KillHost1() if mode == "save_kill" else None)
    into = np.zeros_like(storage)
    restored, reason = p.restore(into)
    report.update(restored_seq=None if restored is None else restored.seq, reason=reason)
    if mode.startswith("save"):
        report["cold_reason"] = reason
        r = p.save(storage, tags, {**INDEX, "writer": "index is host 0's"}).result(timeout=120)
        report.update(save_ok=r.ok, save_reason=r.reason)
    elif restored is not None:
        report.update(exact=bool(np.array_equal(restored.tags, tags) and
                                 np.array_equal(into[tags != -1], storage[tags != -1])),
                      index_ok=restored.index == {**INDEX, "nested": {"t": [1, 2]}, "writer": "index is host 0's"},
                      chunks=restored.chunks)
    else:
        report["all_empty"] = not into.any()
    _report_and_exit(report)


def _report_and_exit(report: dict) -> None:
    print("REPORT " + json.dumps(report), flush=True)
    try:  # host 0 runs the coordination service: leave together, or the others abort mid-report
        from jax._src import distributed

        distributed.global_state.client.wait_at_barrier("test-exit", 10_000)
    except Exception:  # noqa: BLE001 - a killed peer never arrives
        pass
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--host":
        _host_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], int(sys.argv[7]))
