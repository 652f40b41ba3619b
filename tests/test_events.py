"""KV events (issue 22): a router that listens to a replica's events knows exactly what its host RAM
and disk tier can serve.

The proof runs vLLM's real Scheduler with its own ``ZmqEventPublisher`` (built from
``--kv-events-config``, connecting to a real ZMQ SUB socket on localhost), two simulated hosts, host
RAM of 16 chunks and a disk tier of 40, through a chaos workload: evictions and spills, failed
saves on one host, lost slots (failed loads) on the other, reports dropped until saves expire,
fetches from disk, a connector reset with requests running, vLLM's own prefix-cache resets between
waves, then a warm restart of the whole engine. After every step the batches that arrived, decoded
with vLLM's msgspec types, are applied to a router's view (tpuoffload/sim/event_view.py); the set of
(hash, medium) the view holds must equal the connector's own loadable set, asked of its indexes hash
by hash: 0 differences. Every announced block must also join vLLM's HBM events: same hash, tokens
and parent as vLLM's own BlockStored for it.

Negative control: the same run with chunks announced as soon as they are named for a save (before
every host confirmed them) must show differences.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from tpuoffload import counters as C
from tpuoffload.sim.event_view import EventSubscriber, EventView, loadable
from tpuoffload.worker.faults import FaultInjector, FaultPoint

RAM_CHUNKS = 16
DISK_CHUNKS = 40
CHUNK_FILE = 4096 + 65536  # the sim layout's 64 KiB chunk and the file header
SAVE_TIMEOUT_S = 30.0


class EveryNth(FaultInjector):
    """On this host every ``save_every``-th save fails and every ``load_every``-th load loses its
    first slot (counted, so each run sees them whatever the threads' timing; a step loads all its
    hits at once, so the few steps that load all lose one)."""

    def __init__(self, save_every: int, load_every: int) -> None:
        self.every = {FaultPoint.SAVE_PROGRAM: save_every, FaultPoint.LOAD_SLOT_CHECK: load_every}
        self.calls: Counter = Counter()

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        every = self.every.get(point, 0)
        if not every or not n:
            return set()
        self.calls[point] += 1
        if self.calls[point] % every:
            return set()
        if point is FaultPoint.SAVE_PROGRAM:
            raise RuntimeError("test: device-to-host copy failed")
        return {0}


def _engine(tmp_path, endpoint: str, hosts: int, persist: bool):
    """Two hosts: saves fail on host 1, slots are lost on host 0. One host (warm restart runs one
    worker per process): both on it."""
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine

    config = {"num_cpu_chunks": RAM_CHUNKS, "disk_path": str(tmp_path / "disk-{host}"),
              "disk_bytes_to_use": DISK_CHUNKS * CHUNK_FILE, "save_timeout_s": SAVE_TIMEOUT_S}
    if persist:
        config["persist_path"] = str(tmp_path / "ckpt")
    faults = [EveryNth(save_every=5 if h == hosts - 1 else 0, load_every=1 if h == 0 else 0) for h in range(hosts)]
    spec = EngineSpec(num_hosts=hosts, num_blocks=48, extra_config=config,
                      kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})
    return InProcessEngine(spec, faults=faults)


class Watch:
    """One engine's event stream against its connector, checked after every step."""

    def __init__(self, engine, sub: EventSubscriber, gpu_blocks: dict, hashes: list) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.engine, self.sub, self.hashes = engine, sub, hashes
        self.view = EventView(gpu_blocks)
        self.published = 0
        self.diffs = self.checks = 0
        pub = engine.scheduler.kv_event_publisher
        real = pub.publish

        def publish(batch):  # counted, so a check knows which batch is the step's last
            self.published += 1
            real(batch)

        pub.publish = publish
        sub.connect(lambda: pub.publish(KVEventBatch(ts=time.time(), events=[])))
        # After reports were lost the scheduler half's clock jumps by the save timeout, so the
        # saves they confirmed expire (with any other in flight then).
        self.skew = 0.0
        engine.offload.clock = lambda: time.monotonic() + self.skew

    def check(self, _engine=None) -> None:
        self.sub.drain_until(self.published - 1, self.view)
        truth = loadable(self.engine.offload, (h for r in self.hashes for h in r.block_hashes))
        self.diffs += len(truth ^ self.view.offloaded())
        self.checks += 1


def _run(engine, watch: Watch, requests, reset_at: int | None = None, drop: frozenset[int] = frozenset()) -> None:
    """Run ``requests`` to completion, checking after every step; at step ``reset_at`` of this
    wave a connector reset with requests running; the last host's reports lost in the steps ``drop``."""
    start, last = engine.steps, engine.spec.num_hosts - 1
    engine.drop_report = lambda step, host: host == last and step - start in drop
    for r in requests:
        watch.hashes.append(r)
        engine.add_request(r)
    n = 0
    while engine.has_work():
        engine.step()
        watch.check()
        n += 1
        if drop and n == max(drop) + 2:
            watch.skew += SAVE_TIMEOUT_S + 1
        if n == reset_at:
            assert engine.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        assert n < 2000, "engine not idle"
    engine.drop_report = None
    engine.settle()
    watch.check()


def _wave(tag: str, count: int = 12):
    """``count`` requests over 4 prefixes of 6 blocks (the same in every wave), each with its own
    suffix of a block and a half (new in every wave)."""
    from tpuoffload.sim.vllm_setup import make_request

    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 30000) for _ in range(96)] for _ in range(4)]
    rng = random.Random(tag)
    return [make_request(f"{tag}{i}", prefixes[i % 4] + [rng.randrange(3, 30000) for _ in range(24)],
                         max_tokens=4, block_size=16) for i in range(count)]


def _waves(engine, watch: Watch, waves: str, seed: int) -> None:
    """Waves of the same prefixes (fresh suffixes), vLLM's prefix cache reset between them so that
    host RAM and disk serve them. A wave named in upper case is the stormy one: the last host's
    reports are lost in three of its steps, and a connector reset comes at its ninth step."""
    rng = random.Random(seed)
    for i, tag in enumerate(waves):
        if i:
            assert engine.scheduler.reset_prefix_cache()
            watch.check()
        storm = tag.isupper()
        _run(engine, watch, _wave(tag), reset_at=9 if storm else None,
             drop=frozenset(rng.randrange(2, 8) for _ in range(3)) if storm else frozenset())


# (hosts, warm restart, waves) per engine lifetime; the third restarts the second.
LIFETIMES = ((2, False, "aB"), (1, True, "aBa"), (1, True, "c"))


def _chaos_run(tmp_path, lifetimes=LIFETIMES, broken: bool = False):
    """The chaos workload over engine lifetimes, one event stream each into one subscriber.
    Returns each lifetime's Watch and stats totals, and what the last one announced before its
    first request (its restored chunks)."""
    sub = EventSubscriber()
    gpu_blocks: dict = {}
    hashes: list = []
    watches, totals, restored = [], [], {}
    try:
        for k, (hosts, persist, waves) in enumerate(lifetimes):
            engine = _engine(tmp_path / ("persist" if persist else f"run{k}"), sub.endpoint, hosts=hosts,
                             persist=persist)
            if broken:
                from tpuoffload.sim.broken import announce_while_saving

                announce_while_saving(engine.offload)
            w = Watch(engine, sub, gpu_blocks, hashes)
            engine.settle()  # a restart: the hosts' restore reports arrive with the first steps' outputs
            w.check()
            restored = dict(w.view.stored)
            _waves(engine, w, waves, seed=k)
            watches.append(w)
            totals.append(engine.stats.totals())
            engine.close()  # the hosts' shutdown checkpoint first, then the scheduler's (its events' records)
    finally:
        sub.close()
    return watches, totals, restored


@pytest.mark.timeout(300)
def test_events_rebuild_exactly_what_host_ram_and_disk_can_serve(tmp_path):
    watches, totals, restored = _chaos_run(tmp_path)
    diffs = [w.diffs for w in watches]
    print(f"KV events: {sum(w.checks for w in watches)} checks, {sum(diffs)} differences; "
          f"announced {[w.view.stored for w in watches]}, withdrawn {[w.view.removed for w in watches]}")
    assert diffs == [0, 0, 0]
    runs = sum(totals, Counter())
    # The chaos happened: every way a chunk appears and disappears.
    assert runs[C.EVICTED] > 0 and runs[C.SPILLS_CONFIRMED] > 0, runs
    assert runs[C.FETCHES_ISSUED] > runs[C.FETCHES_FAILED], runs  # chunks came back from disk
    assert runs[C.SAVE_FAILURES] > 0 and runs[C.LEDGER_EXPIRED] > 0 and runs[C.DISCARDED] > 0, runs
    assert runs[C.REVOKED] > 0 and runs[C.RESETS] == 2, runs
    restart = totals[-1]
    assert restart[C.RESTORED_READY] > 0 and restart[C.DISK_RESTORED_READY] > 0, restart
    # The restart announced what it restored, before any new save.
    assert restored == {"CPU": restart[C.RESTORED_READY], "STORAGE": restart[C.DISK_RESTORED_READY]}, (restored, restart)
    for w in watches:
        assert w.sub.gaps == 0 and not w.view.errors and w.view.ranks == {0}, (w.view.errors[:5], w.view.ranks)
        assert w.view.stored["CPU"] and w.view.removed["CPU"] and w.view.stored["STORAGE"], (w.view.stored, w.view.removed)
    assert watches[0].view.removed["STORAGE"] > 0


@pytest.mark.timeout(300)
def test_negative_control_announcing_at_save_time_is_caught(tmp_path):
    watches, totals, _ = _chaos_run(tmp_path, lifetimes=((1, False, "aB"),), broken=True)
    assert totals[0][C.SAVE_FAILURES] > 0 and totals[0][C.LEDGER_EXPIRED] > 0, totals[0]
    print(f"KV events announced at save time: {watches[0].diffs} differences in {watches[0].checks} checks")
    assert watches[0].diffs > 0
