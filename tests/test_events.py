"""KV events (issue 22): a router that listens to a replica's events knows exactly what its host RAM
and disk tier can serve.

The proof runs vLLM's real Scheduler with its own ``ZmqEventPublisher`` (built from
``--kv-events-config``, connecting to a real ZMQ SUB socket on localhost), host RAM of 16 chunks and
a disk tier of 40, through a chaos workload over four engine lifetimes (two hosts; one host in lazy
mode; one host with warm restart, then its restart): evictions and spills, failed saves, lost slots
(failed loads), reports dropped until saves expire, fetches from disk, a connector reset with
requests running, vLLM's own prefix-cache resets between waves. After every step the batches that
arrived, decoded with vLLM's msgspec types, are applied to a router's view
(tpuoffload/sim/event_view.py); the set of (hash, medium) the view holds must equal the connector's
own loadable set, asked of its indexes hash by hash: 0 differences. Every announced block must also
join vLLM's HBM events: same hash, tokens and parent as vLLM's own BlockStored for it.

The same chaos, with warm restart, for two hybrid models, each KV cache group's chunks announced
with its group and spec kind: a sliding-window hybrid (gpt-oss-like: vLLM's hybrid KV cache
manager) and a GDN hybrid (Qwen3.5-like: tpu-inference's arrays, compact state pool and hybrid
coordinator under vLLM's scheduler; attention chunks and state chunks in host RAM's two slot pools,
the mirror groups announcing nothing).

The chaos does not depend on the threads' timing, however loaded the machine: faults are counted
(``EveryNth``), saves finish on a beat of one step (so which of them a dropped report confirmed is
fixed), the scheduler half's clock moves only when the test moves it, and the scheduler half walks
the requests with blocks to save in the scheduler's order (``RequestLifecycle._filled``). Without a
disk tier (the two hybrids) every run is the same step for step, whatever Python's hash seed; the
disk tier's spills and fetches still finish on their own threads (reported in their step or a later
one).

Negative control: the same run with chunks announced as soon as they are named for a save (before
every host confirmed them) must show differences.

Below: the scheduler half alone (payloads, withdrawals, restart records), and tpu-inference's
DPScheduler (each rank publishes as its own DP rank).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from tpuoffload import counters as C
from tpuoffload.manager.events import MEDIUM_CPU
from tpuoffload.sim.event_view import MEDIUM_GPU, EventSubscriber, EventView, loadable
from tpuoffload.worker.faults import FaultInjector, FaultPoint

RAM_CHUNKS = 16
DISK_CHUNKS = 40
CHUNK_FILE = 4096 + 65536  # the sim layout's 64 KiB chunk and the file header
SAVE_TIMEOUT_S = 30.0
# The GDN hybrid (``_gdn_spec``): host RAM of 32 KV chunks, 3/8 of it for state chunks (each the
# size of about 4 KV chunks): 20 KV slots and 3 state slots, for 4 prefixes of 3 blocks (``_wave``);
# 8 requests a wave; every third slot check of a load loses a slot (a load checks its KV slots,
# then its state slots: some loads fail on either, some succeed).
GDN_RAM_CHUNKS = 32
GDN_STATE_FRACTION = 0.375
GDN_PREFIX_BLOCKS = 3
GDN_WAVE = 8
GDN_LOAD_EVERY = 3


class EveryNth(FaultInjector):
    """On this host every ``load_every``-th load loses its first slot (a step loads all its hits at
    once, so the few steps that load all lose one) and the saves of every ``save_every``-th step
    that saves fail, on a fixed beat, so that each run sees the same whatever the threads' timing.

    The beat (``beat``, by ``_step``): each step's saves are held (in flight, unreported) until the
    next step begins and finish before it runs, so each is confirmed or failed in the report of the
    step after its own. Which saves a dropped report carries and which chunks are READY to evict or
    to hit, hence every chaos counter, are then the same in every run, however slow the threads.
    A step's saves finish concurrently (several save threads, a pool each for KV and state chunks),
    so they fail or succeed together: the first of them to finish decides for all."""

    def __init__(self, save_every: int, load_every: int) -> None:
        self.every = {FaultPoint.SAVE_PROGRAM: save_every, FaultPoint.LOAD_SLOT_CHECK: load_every}
        self.calls: Counter = Counter()  # loads; steps whose saves finished
        self.gate = threading.Event()
        self.gate.set()
        self.beats = 0
        self._decided = (-1, False)  # (beat, whether the saves released on it fail)
        self._lock = threading.Lock()

    def beat(self) -> None:
        """Let the saves held so far finish (``_step`` waits for them, then closes the gate)."""
        self.beats += 1
        self.gate.set()

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        every = self.every.get(point, 0)
        if point is FaultPoint.SAVE_PROGRAM:  # (on a save thread)
            assert self.gate.wait(SAVE_TIMEOUT_S), "a save held past its beat"
            if not every or not n:
                return set()
            with self._lock:
                beat, fail = self._decided
                if beat != self.beats:
                    self.calls[point] += 1
                    fail = self.calls[point] % every == 0
                    self._decided = (self.beats, fail)
            if fail:
                raise RuntimeError("test: device-to-host copy failed")
            return set()
        if not every or not n:
            return set()
        self.calls[point] += 1
        return set() if self.calls[point] % every else {0}


@dataclass(frozen=True)
class Lifetime:
    """One engine's run: its hosts, warm restart (in one process: one host), lazy offload, a hybrid
    model (vLLM's hybrid KV cache manager: a sliding-window and a full-attention KV cache group; no
    disk tier then) or a GDN hybrid (Qwen3.5-like: tpu-inference's hybrid coordinator, a GDN state
    group, two that mirror it and a full-attention group; host RAM of a KV and a state slot pool),
    and its waves (``_waves``)."""

    hosts: int
    waves: str
    persist: bool = False
    lazy: bool = False
    hybrid: bool = False
    gdn: bool = False


def _engine(tmp_path, endpoint: str, life: Lifetime):
    """Two hosts: saves fail on host 1, slots are lost on host 0. One host: both on it."""
    from tpuoffload.sim.engine import EngineSpec, InProcessEngine
    from tpuoffload.sim.hybrid_layouts import GPT_OSS_LIKE

    hosts = life.hosts
    config = {"num_cpu_chunks": RAM_CHUNKS, "save_timeout_s": SAVE_TIMEOUT_S}
    if life.gdn:
        config.update(num_cpu_chunks=GDN_RAM_CHUNKS, state_ram_fraction=GDN_STATE_FRACTION)
    if not life.hybrid and not life.gdn:
        config.update(disk_path=str(tmp_path / "disk-{host}"), disk_bytes_to_use=DISK_CHUNKS * CHUNK_FILE)
    if life.persist:
        config["persist_path"] = str(tmp_path / "ckpt")
    if life.lazy:
        config["lazy_offload"] = True
    load_every = GDN_LOAD_EVERY if life.gdn else 1
    faults = [EveryNth(save_every=5 if h == hosts - 1 else 0, load_every=load_every if h == 0 else 0)
              for h in range(hosts)]
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    model = (dict(hybrid=dataclasses.replace(GPT_OSS_LIKE, max_model_len=1024), kv_budget_bytes=8 << 20)
             if life.hybrid else dict(gdn=_gdn_spec()) if life.gdn else dict(num_blocks=48))
    engine = InProcessEngine(EngineSpec(num_hosts=hosts, extra_config=config, kv_events=kv_events, **model),
                             faults=faults)
    engine.faults = faults
    return engine


def _gdn_spec():
    from tpuoffload.sim import gdn_layout as gl

    return dataclasses.replace(gl.QWEN35_LIKE, max_num_seqs=4, max_num_batched_tokens=256)


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
        # The scheduler half's clock (save deadlines) stands still but for one jump: after reports
        # were lost it jumps by the save timeout, so the saves they confirmed expire (with any
        # other in flight then). A slow step (a first compile, a loaded machine) expires nothing.
        self.skew = 0.0
        engine.offload.clock = lambda: self.skew

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
        _step(engine)
        watch.check()
        n += 1
        if drop and n == max(drop) + 2:
            watch.skew += SAVE_TIMEOUT_S + 1
        if reset_at is not None and n >= reset_at and len(engine.offload.index) and not _holding(engine):
            # (vLLM cannot reset while a request's blocks are held for a load or a save: at the
            # first step from reset_at without one, and with chunks held or being saved to revoke)
            assert engine.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
            reset_at = None
        assert n < 2000, "engine not idle"
    engine.drop_report = None
    for f in engine.faults:  # the last step's saves (settle waits for them)
        f.beat()
    engine.settle()
    watch.check()


def _step(engine) -> None:
    """One engine step on the saves' beat (``EveryNth``): the saves held so far finish first, this
    step's are held until the next step (or ``_run``'s end)."""
    for f in engine.faults:
        f.beat()
    for conn in engine.connectors:
        assert conn.worker.wait_idle(SAVE_TIMEOUT_S)
    for f in engine.faults:
        f.gate.clear()
    engine.step()


def _holding(engine) -> bool:
    """A request holds blocks vLLM's reset cannot free: waiting for its load, or finished with its
    blocks kept until its saves are sent (``request_finished`` said so). vLLM's
    ``reset_prefix_cache(reset_running_requests=True)`` raises then, whatever the connector."""
    from vllm.v1.request import RequestStatus

    return any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or r.is_finished()
               for r in engine.scheduler.requests.values())


def _wave(engine, tag: str, count: int = 12):
    """``count`` requests over 4 prefixes of 6 blocks (the same in every wave), each with its own
    suffix of a block and a half (new in every wave).

    A GDN hybrid's hit needs the state chunk at its last block, saved only where a step ended
    (vLLM's mamba "align" mode ends a prefill's step at its last whole block): there the prefixes
    are of ``GDN_PREFIX_BLOCKS`` blocks; the first 4 requests' suffixes are a block and a half (each
    saves a new block and the state after it, each wave), the others' shorter than a block (each
    saves its prefix's state, last in the wave, so that the next wave can hit the prefix whole)."""
    from tpuoffload.sim.vllm_setup import make_request

    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 30000) for _ in range(96)] for _ in range(4)]
    rng = random.Random(tag)
    if engine.spec.gdn is None:
        return [make_request(f"{tag}{i}", prefixes[i % 4] + [rng.randrange(3, 30000) for _ in range(24)],
                             max_tokens=4, block_size=16) for i in range(count)]
    from tpuoffload.sim import gdn_layout as gl

    return [gl.make_request(engine.gdn_layout, f"{tag}{i}", prefixes[i % 4][:16 * GDN_PREFIX_BLOCKS]
                            + [rng.randrange(3, 30000) for _ in range(24 if i < 4 else 8)], max_tokens=4)
            for i in range(count)]


def _waves(engine, watch: Watch, waves: str, seed: int) -> None:
    """Waves of the same prefixes (fresh suffixes), vLLM's prefix cache reset between them so that
    host RAM and disk serve them. A wave named in upper case is the stormy one: the last host's
    reports are lost in three of its first steps, and a connector reset comes from its sixth step."""
    rng = random.Random(seed)
    for i, tag in enumerate(waves):
        if i:
            assert engine.scheduler.reset_prefix_cache()
            watch.check()
        storm = tag.isupper()
        _run(engine, watch, _wave(engine, tag, GDN_WAVE if engine.spec.gdn else 12), reset_at=6 if storm else None,
             drop=frozenset(rng.randrange(1, 5) for _ in range(3)) if storm else frozenset())


# The last restarts the one before.
LIFETIMES = (Lifetime(2, "aB"), Lifetime(1, "aB", lazy=True), Lifetime(1, "aBa", persist=True),
             Lifetime(1, "c", persist=True))
HYBRID_LIFETIMES = (Lifetime(1, "aBa", persist=True, hybrid=True), Lifetime(1, "c", persist=True, hybrid=True))
GDN_LIFETIMES = (Lifetime(1, "aBa", persist=True, gdn=True), Lifetime(1, "c", persist=True, gdn=True))


def _chaos_run(tmp_path, lifetimes=LIFETIMES, broken: bool = False):
    """The chaos workload over engine lifetimes, one event stream each into one subscriber.
    Returns each lifetime's Watch and stats totals, and what the last one announced before its
    first request (its restored chunks)."""
    sub = EventSubscriber()
    gpu_blocks: dict = {}
    hashes: list = []
    watches, totals, restored = [], [], {}
    try:
        for k, life in enumerate(lifetimes):
            engine = _engine(tmp_path / ("persist" if life.persist else f"run{k}"), sub.endpoint, life)
            if broken:
                from tpuoffload.sim.broken import announce_while_saving

                announce_while_saving(engine.offload)
            w = Watch(engine, sub, gpu_blocks, hashes)
            engine.settle()  # a restart: the hosts' restore reports arrive with the first steps' outputs
            w.check()
            restored = dict(w.view.stored)
            w.restored = w.view.offloaded()
            _waves(engine, w, life.waves, seed=k)
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
    assert diffs == [0] * len(LIFETIMES)
    runs = sum(totals, Counter())
    # The chaos happened: every way a chunk appears and disappears.
    assert runs[C.EVICTED] > 0 and runs[C.SPILLS_CONFIRMED] > 0, runs
    assert runs[C.FETCHES_ISSUED] > runs[C.FETCHES_FAILED], runs  # chunks came back from disk
    assert runs[C.SAVE_FAILURES] > 0 and runs[C.LEDGER_EXPIRED] > 0 and runs[C.DISCARDED] > 0, runs
    assert runs[C.REVOKED] > 0 and runs[C.RESETS] == sum(w.isupper() for life in LIFETIMES for w in life.waves), runs
    restart = totals[-1]
    assert restart[C.RESTORED_READY] > 0 and restart[C.DISK_RESTORED_READY] > 0, restart
    # The restart announced what it restored, before any new save.
    assert restored == {"CPU": restart[C.RESTORED_READY], "STORAGE": restart[C.DISK_RESTORED_READY]}, (restored, restart)
    for w in watches:
        assert w.sub.gaps == 0 and not w.view.errors and w.view.ranks == {0}, (w.view.errors[:5], w.view.ranks)
        assert w.view.stored["CPU"] and w.view.removed["CPU"] and w.view.stored["STORAGE"], (w.view.stored, w.view.removed)
    assert watches[0].view.removed["STORAGE"] > 0


@pytest.mark.timeout(300)
def test_events_of_every_kv_cache_group_are_exact(tmp_path):
    """A hybrid model (gpt-oss-like: a sliding-window and a full-attention KV cache group, vLLM's
    hybrid KV cache manager on) through the same chaos and a warm restart: each group's chunks are
    announced under vLLM's own hash of the block with their ``group_idx``, and the view equals what
    host RAM holds for every group."""
    watches, totals, restored = _chaos_run(tmp_path, lifetimes=HYBRID_LIFETIMES)
    diffs = [w.diffs for w in watches]
    groups = {key[2] for w in watches for key in w.view.ever if key[1] != MEDIUM_GPU}
    print(f"KV events, two KV cache groups: {sum(w.checks for w in watches)} checks, {sum(diffs)} differences; "
          f"announced {[w.view.stored for w in watches]} in groups {sorted(groups)}")
    assert diffs == [0, 0] and groups == {0, 1}
    runs = sum(totals, Counter())
    assert runs[C.EVICTED] > 0 and runs[C.SAVE_FAILURES] > 0 and runs[C.LEDGER_EXPIRED] > 0, runs
    assert runs[C.FAILED_REQUESTS] > 0 and runs[C.DISCARDED] > 0 and runs[C.REVOKED] > 0, runs
    assert restored == {"CPU": totals[-1][C.RESTORED_READY], "STORAGE": 0} and restored["CPU"] > 0, restored
    for w in watches:
        assert w.sub.gaps == 0 and not w.view.errors, w.view.errors[:5]


@pytest.mark.timeout(300)
def test_events_of_a_gdn_hybrid_are_exact(tmp_path):
    """A GDN hybrid (Qwen3.5-like: tpu-inference's arrays, compact state pool and hybrid coordinator
    under vLLM's scheduler) through the same chaos and a warm restart: attention chunks (the KV
    slot pool) and state chunks (the state slot pool: one row of every GDN layer, saved at the
    block where a step ended) are announced under vLLM's hash of their block, each with its group
    and spec kind; the mirror groups announce nothing; the view equals what host RAM holds of both
    pools, after every step."""
    watches, totals, restored = _chaos_run(tmp_path, lifetimes=GDN_LIFETIMES)
    diffs = [w.diffs for w in watches]
    kv_groups = watches[0].engine.offload.kv_groups
    state, attention = kv_groups.state_group, kv_groups.windows.index(None)
    offloaded = {key for w in watches for key in w.view.ever if key[1] != MEDIUM_GPU}
    print(f"KV events, GDN hybrid ({kv_groups.describe()}): {sum(w.checks for w in watches)} checks, "
          f"{sum(diffs)} differences; announced {[w.view.stored for w in watches]}, withdrawn "
          f"{[w.view.removed for w in watches]}, restored {restored}")
    assert diffs == [0, 0]
    assert {key[2] for key in offloaded} == {state, attention}, sorted({key[2] for key in offloaded})
    for w in watches:
        assert w.sub.gaps == 0 and not w.view.errors, w.view.errors[:5]
        assert w.view.kinds == {state: {"mamba"}, attention: {"full_attention"}}, w.view.kinds
    # State chunks were withdrawn too (evicted, discarded, revoked), not only attention chunks.
    withdrawn = {key for w in watches for key in w.view.ever - w.view.held if key[1] == MEDIUM_CPU}
    assert {key[2] for key in withdrawn} == {state, attention}
    runs = sum(totals, Counter())
    assert runs[C.EVICTED] > 0 and runs[C.SAVE_FAILURES] > 0 and runs[C.LEDGER_EXPIRED] > 0, runs
    assert runs[C.FAILED_REQUESTS] > 0 and runs[C.DISCARDED] > 0 and runs[C.REVOKED] > 0 and runs[C.RESETS] == 1, runs
    assert runs[C.CHUNKS_LOADED] > 0, runs  # and loads that did not fail
    # The restart announced what it restored, chunks of both pools, before any new save.
    assert restored == {"CPU": totals[-1][C.RESTORED_READY], "STORAGE": 0} and restored["CPU"] > 0, restored
    assert {key[2] for key in watches[-1].restored} == {state, attention}


@pytest.mark.timeout(300)
def test_negative_control_announcing_at_save_time_is_caught(tmp_path):
    watches, totals, _ = _chaos_run(tmp_path, lifetimes=(Lifetime(1, "aB"),), broken=True)
    assert totals[0][C.SAVE_FAILURES] > 0 and totals[0][C.LEDGER_EXPIRED] > 0, totals[0]
    print(f"KV events announced at save time: {watches[0].diffs} differences in {watches[0].checks} checks")
    assert watches[0].diffs > 0


# ---------------------------------------------------------------------------- the scheduler half alone
def _half(num_chunks: int = 8, hosts: int = 2, int_hashes: bool = True, **extra):
    from tpuoffload.config import parse_config
    from tpuoffload.manager import OffloadScheduler
    from tpuoffload.manager.events import EventFormat

    fmt = EventFormat(width=32, block_size=16, int_hashes=int_hashes, group_specs=(("full_attention", None),))
    return OffloadScheduler(parse_config({"num_cpu_chunks": num_chunks, **extra}), block_size=16, chunk_bytes=1024,
                            num_hosts=hosts, events=fmt)


def _request(req_id: str, blocks: int, seed: int, lora=None):
    from tpuoffload.sim.vllm_setup import make_request

    rng = random.Random(seed)
    req = make_request(req_id, [rng.randrange(3, 30000) for _ in range(blocks * 16)], block_size=16)
    req.lora_request = lora
    return req


def _save(half, runs, step: int = 0):
    """Plan the saves of ``runs`` ((request, first block, count)) as the eager path does."""
    from tpuoffload.manager.hash_table import PackedHashes

    origins = [(r, s, n, 0) for r, s, n in runs]
    hashes = [r.block_hashes[s:s + n] for r, s, n in runs]
    blocks = list(range(sum(n for _, _, n in runs)))
    return half.saves.plan(blocks, PackedHashes.of_runs(hashes), step, origins)


def _confirm(half, batch, hosts) -> None:
    for h in hosts:
        half.ledger.report(h, ok=((batch.save_ids[0], batch.save_ids[-1] + 1),))
    half._apply_resolved()


def test_stored_only_once_every_host_confirmed_with_vllms_payload():
    from vllm.distributed.kv_events import BlockStored
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    half = _half()
    lora = LoRARequest("adapter-a", 7, "/nowhere")
    a, b = _request("a", 5, 1), _request("b", 3, 2, lora)
    batch = _save(half, [(a, 1, 4), (b, 0, 3)])
    assert list(half.take_events()) == []  # SAVING: nothing to announce
    _confirm(half, batch, [0])
    assert list(half.take_events()) == []  # one host of two
    _confirm(half, batch, [1])
    ev_a, ev_b = half.take_events()
    assert isinstance(ev_a, BlockStored) and ev_a.medium == "CPU" and ev_a.group_idx == 0
    assert ev_a.block_hashes == [ext(h) for h in a.block_hashes[1:5]]
    assert ev_a.parent_block_hash == ext(a.block_hashes[0])  # the block before the run, from the request
    assert ev_a.token_ids == list(a.all_token_ids[16:80]) and ev_a.block_size == 16
    assert ev_a.kv_cache_spec_kind == "full_attention" and ev_a.lora_id is None and ev_a.lora_name is None
    assert ev_b.block_hashes == [ext(h) for h in b.block_hashes] and ev_b.parent_block_hash is None
    assert (ev_b.lora_id, ev_b.lora_name) == (7, "adapter-a")
    assert list(half.take_events()) == []


def test_eviction_discard_and_reset_withdraw_exactly_what_was_loadable():
    from vllm.distributed.kv_events import BlockRemoved
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    half = _half(num_chunks=4, hosts=1)
    a, b, c = _request("a", 4, 1), _request("b", 2, 2), _request("c", 2, 3)
    _confirm(half, _save(half, [(a, 0, 4)]), [0])
    half.take_events()
    half.index.pin(half.index.ready_prefix_saved(a.block_hashes[3:4]).slots)  # a load in flight: not evicted
    _confirm(half, _save(half, [(b, 0, 2)]), [0])  # evicts a's two least recently used chunks
    removed, stored = half.take_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert sorted(removed.block_hashes) == sorted(ext(h) for h in a.block_hashes[1:3])  # prefix tails go first
    assert stored.block_hashes == [ext(h) for h in b.block_hashes]
    slot = half.index.ready_slot(b.block_hashes[0])
    assert half.index.discard(slot, half.index.save_id_of(slot))  # a load of it failed somewhere
    (failed,) = half.take_events()
    assert failed.block_hashes == [ext(b.block_hashes[0])]
    batch = _save(half, [(c, 0, 1)])  # SAVING when the reset comes (in the freed slot): never announced
    assert half.reset_cache()
    (gone,) = half.take_events()
    assert sorted(gone.block_hashes) == sorted(ext(h) for h in [a.block_hashes[0], a.block_hashes[3], b.block_hashes[1]])
    _confirm(half, batch, [0])
    assert list(half.take_events()) == [] and half.index.num_ready() == 0


def test_block_hashes_as_bytes_when_vllm_publishes_bytes():
    half = _half(hosts=1, int_hashes=False)
    a = _request("a", 2, 1)
    _confirm(half, _save(half, [(a, 0, 2)]), [0])
    (ev,) = half.take_events()
    assert ev.block_hashes == list(a.block_hashes)


def test_without_kv_events_nothing_is_recorded():
    from tpuoffload.config import parse_config
    from tpuoffload.manager import OffloadScheduler
    from tpuoffload.manager.events import NO_EVENTS

    half = OffloadScheduler(parse_config({"num_cpu_chunks": 8}), block_size=16, chunk_bytes=1024, num_hosts=1)
    assert half.index.events is NO_EVENTS
    _confirm(half, _save(half, [(_request("a", 2, 1), 0, 2)]), [0])
    assert half.index.num_ready() == 2 and half.take_events() == ()


def test_restart_adopts_only_chunks_whose_records_were_kept(tmp_path):
    """The records written beside the checkpoints describe restored chunks; a restored chunk with
    no record is not made loadable (it could not be announced)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    from tpuoffload.manager.event_meta import META_FILE
    from tpuoffload.manager.hash_table import HashKeys
    from tpuoffload.messages import RESTORED_ROW, PersistReport

    path = str(tmp_path / "ckpt")
    first = _half(hosts=1, persist_path=path)
    first.tier("persist").on_report({0: PersistReport(restored=b"")})
    a, b = _request("a", 3, 1), _request("b", 2, 2)
    _confirm(first, _save(first, [(a, 0, 3)]), [0])
    first.close()  # a's records written; b is saved afterwards, as if after the last checkpoint
    _confirm(first, _save(first, [(b, 0, 2)]), [0])
    assert (tmp_path / "ckpt" / META_FILE).exists()

    second = _half(hosts=1, persist_path=path)
    rows = np.zeros(5, RESTORED_ROW)
    keys = HashKeys.of(list(a.block_hashes) + list(b.block_hashes))
    rows["slot"], rows["save_id"], rows["k1"], rows["k2"] = np.arange(5), np.arange(5), keys.k1, keys.k2
    second.tier("persist").on_report({0: PersistReport(restored=rows.tobytes())})
    (ev,) = second.take_events()
    assert ev.block_hashes == [ext(h) for h in a.block_hashes] and ev.token_ids == list(a.all_token_ids)
    assert second.index.num_ready() == 3 and second.index.ready_slot(b.block_hashes[0]) < 0


# ---------------------------------------------------------------------------- tpu-inference's DPScheduler
def _free_ports(n: int) -> int:
    """A base port with ``n`` free ports from it."""
    import socket

    for _ in range(100):
        base = random.randrange(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def test_ranks_of_one_config_would_bind_one_endpoint():
    """Why DPScheduler needs ``publish_as_dp_rank``: vLLM's publisher offsets its endpoint by its
    data parallel rank only; two with the rank every DPScheduler rank process has (0) collide."""
    import zmq
    from vllm.distributed.kv_events import ZmqEventPublisher

    endpoint = f"tcp://*:{_free_ports(2)}"
    first = ZmqEventPublisher(0, endpoint=endpoint)
    try:
        with pytest.raises(zmq.ZMQError, match="in use"):
            ZmqEventPublisher(0, endpoint=endpoint)
        second = ZmqEventPublisher(1, endpoint=endpoint)  # what each rank gets now
        second.shutdown()
    finally:
        first.shutdown()


@pytest.mark.timeout(120)
def test_dpscheduler_ranks_publish_on_their_own_port_as_their_own_rank():
    """tpu-inference's own DPScheduler (2 ranks, forked processes), each rank's vLLM scheduler with
    its own publisher built from one ``--kv-events-config`` (bind ``tcp://*:PORT``): rank r binds
    PORT + r and labels its batches ``data_parallel_rank`` r, as vLLM's own DP ranks do, so a
    router keeps the ranks' caches apart."""
    import zmq
    from vllm.v1.outputs import ModelRunnerOutput

    from tpuoffload.sim.tpu_layouts import LAYOUTS, sharding_config
    from tpuoffload.sim.vllm_setup import is_dp_scheduler, make_request, make_scheduler

    port = _free_ports(2)
    sched = make_scheduler(num_blocks=64, block_size=16, kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22},
                           tensor_parallel_size=2, sharding_config=sharding_config(LAYOUTS["bf16-dp2-tp4"]),
                           kv_events={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    ctx = zmq.Context.instance()
    subs = []
    try:
        assert is_dp_scheduler(sched) and sched.dp_size == 2
        for p in (port, port + 1):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(f"tcp://127.0.0.1:{p}")
            subs.append(sub)
        from vllm.distributed.kv_events import KVEventBatch
        import msgspec

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        seen: dict[int, set] = {0: set(), 1: set()}
        rng = random.Random(0)
        deadline = time.monotonic() + 60
        n = 0
        while not (seen[0] and seen[1]):
            assert time.monotonic() < deadline, seen
            for _ in range(2):  # one request per rank (DPScheduler places them by load)
                sched.add_request(make_request(f"r{n}", [rng.randrange(3, 30000) for _ in range(64)],
                                               max_tokens=1, block_size=16))
                n += 1
            so = sched.schedule()
            req_ids = list(so.num_scheduled_tokens)
            sched.update_from_output(so, ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[100] for _ in req_ids]))
            for rank, sub in enumerate(subs):
                while sub.poll(200):
                    _topic, _seq, payload = sub.recv_multipart()
                    seen[rank].add(decode(payload).data_parallel_rank)
        assert seen == {0: {0}, 1: {1}}
    finally:
        for sub in subs:
            sub.close(0)
        sched.shutdown()


def test_each_dp_ranks_restart_records_are_kept_and_read(tmp_path):
    """Under DPScheduler every rank's scheduler half writes the event records of its chunks beside
    the checkpoints (manager/event_meta.py), each its own file; at the next start a half reads every
    rank's, so each rank's restored chunks are found. Before, a rank's half could not write them at
    all (its index's sink, RankNews, did not pass the records on: the rank process raised at
    shutdown), and both ranks named one file, the last writer's records replacing the other's."""
    from tpuoffload.config import parse_config
    from tpuoffload.manager import OffloadScheduler
    from tpuoffload.manager.event_meta import load_meta
    from tpuoffload.manager.events import EventFormat
    from tpuoffload.manager.hash_table import HashKeys
    from tpuoffload.manager.topology import DPRank
    from tpuoffload.messages import PersistReport

    path = str(tmp_path / "ckpt")
    fmt = EventFormat(width=32, block_size=16, int_hashes=True, group_specs=(("full_attention", None),))

    def rank_half(rank: int | None):
        half = OffloadScheduler(parse_config({"num_cpu_chunks": 64, "persist_path": path}), block_size=16,
                                chunk_bytes=1024, num_hosts=1, events=fmt,
                                dp=DPRank(ranks=2, num_blocks=64, source=1000 + (rank or 0)))
        half.dp_rank = rank  # (what the workers' first report tells a rank's half)
        half.tier("persist").on_report({0: PersistReport(restored=b"")})
        return half

    requests = [_request("a", 3, 1), _request("b", 2, 2)]
    for rank, req in enumerate(requests):  # each rank saves its own request's blocks, then shuts down
        half = rank_half(rank)
        _confirm(half, _save(half, [(req, 0, len(req.block_hashes))]), [0])
        half.close()
    meta = load_meta(path, rank_half(None)._events_log)  # a rank of the next start, before any report
    assert meta is not None and len(meta) == 5
    for req in requests:
        rows, found = meta.lookup(HashKeys.of(list(req.block_hashes)))
        assert found.all(), req.request_id
        assert [r.tobytes() for r in rows["hash"]] == list(req.block_hashes)


# ---------------------------------------------------------------------------- each DPScheduler rank, exact
# In a rank process (forked by DPScheduler, with the patches RankEvents installs before the fork):
# its scheduler half, the requests it was asked about, the hashes known from earlier lifetimes.
_RANK_SIDE: dict = {}


def _unpatched(fn):
    return getattr(fn, "unpatched", fn)


class RankEvents:
    """The KV events of every rank of a DPScheduler pod slice (tpu-inference's rank processes, each
    with its own vLLM scheduler and publisher built from one ``--kv-events-config`` binding
    ``tcp://*:PORT``), checked batch by batch against that rank's own truth.

    The truth comes from inside each rank process: installed before the slice forks them, a patch
    of vLLM's ``ZmqEventPublisher.publish`` appends, each time the rank's scheduler hands its
    publisher a batch, what the rank's scheduler half can serve at that moment (``loadable``: asked
    of its indexes hash by hash, over the hashes of every request the half was asked about) to the
    file of the rank that DPScheduler started the process as. The rank's n-th record and its n-th
    batch (sequence number n) describe the same moment. Here a SUB socket per rank, connected to
    PORT + r before the slice starts, decodes rank r's batches into a router's view; after the
    n-th, the view must equal the n-th record. ``spec_fields`` go into the slice's SliceSpec."""

    def __init__(self, monkeypatch, path, ranks: int, after: "RankEvents | None" = None) -> None:
        import pickle

        from vllm.distributed.kv_events import ZmqEventPublisher

        from tpuoffload.manager.offload_scheduler import OffloadScheduler
        from tpuoffload.manager.topology import dp_scheduler_rank

        self.ranks, self.dir = ranks, path
        path.mkdir(parents=True)
        port = _free_ports(ranks)
        self.spec_fields = {"kv_events": {"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": f"tcp://*:{port}"}}
        self.subs = [EventSubscriber(connect=f"tcp://127.0.0.1:{port + r}") for r in range(ranks)]
        # Each rank's view joins its own HBM events (a restart's, its previous lifetime's too).
        self.views = [EventView(dict(after.views[r].gpu_blocks) if after is not None else None) for r in range(ranks)]
        self.diffs, self.checks = [0] * ranks, [0] * ranks
        self.restored: list[set] = [set() for _ in range(ranks)]  # what each rank announced before its first request
        # Every block hash the ranks were asked about, this lifetime's and the earlier ones' (a
        # restart restores chunks of the hashes of an earlier lifetime's requests).
        self.hashes: set = set(after.hashes) if after is not None else set()
        self._offsets = [0] * ranks
        _RANK_SIDE.clear()
        _RANK_SIDE.update(known=frozenset(self.hashes), half=None, requests={})

        # (A later lifetime's patches replace an earlier one's: each wraps the original.)
        init, matched = _unpatched(OffloadScheduler.__init__), _unpatched(OffloadScheduler.get_num_new_matched_tokens)
        publish = _unpatched(ZmqEventPublisher.publish)
        out = str(path)

        def init_(half, *args, **kwargs):
            init(half, *args, **kwargs)
            _RANK_SIDE["half"] = half

        def matched_(half, request, num_computed_tokens):
            _RANK_SIDE["requests"][request.request_id] = request
            return matched(half, request, num_computed_tokens)

        def publish_(pub, batch):
            publish(pub, batch)
            side = _RANK_SIDE
            hashes = {h for r in side["requests"].values() for h in r.block_hashes}
            try:
                truth = loadable(side["half"], hashes | side["known"]) if side["half"] is not None else set()
            except Exception as e:  # reported by the test
                truth = f"{type(e).__name__}: {e}"
            with open(f"{out}/rank{dp_scheduler_rank()}.pkl", "ab") as f:
                pickle.dump((truth, hashes), f)

        init_.unpatched, matched_.unpatched, publish_.unpatched = init, matched, publish
        monkeypatch.setattr(OffloadScheduler, "__init__", init_)
        monkeypatch.setattr(OffloadScheduler, "get_num_new_matched_tokens", matched_)
        monkeypatch.setattr(ZmqEventPublisher, "publish", publish_)

    def _records(self, rank: int) -> list:
        import pickle

        records = []
        try:
            with open(self.dir / f"rank{rank}.pkl", "rb") as f:
                f.seek(self._offsets[rank])
                while True:
                    try:
                        records.append(pickle.load(f))
                    except EOFError:
                        break
                self._offsets[rank] = f.tell()
        except FileNotFoundError:
            pass
        return records

    def check(self) -> None:
        """Apply every batch each rank published so far, comparing after each with its record."""
        for r, (sub, view) in enumerate(zip(self.subs, self.views)):
            for truth, hashes in self._records(r):
                assert not isinstance(truth, str), f"rank {r}: {truth}"
                self.hashes |= hashes
                got = sub.recv(20.0)
                assert got is not None, f"rank {r}: batch {sub.last_seq + 1} did not arrive"
                seq, batch = got
                sub.gaps += seq != sub.last_seq + 1
                sub.last_seq = seq
                view.apply(batch)
                self.diffs[r] += len(truth ^ view.offloaded())
                self.checks[r] += 1
            assert not sub.sock.poll(0), f"rank {r}: a batch without its record"

    def note_restored(self) -> None:
        """After the restart's first (empty) steps: what each rank announced of its restored chunks."""
        self.check()
        self.restored = [v.offloaded() for v in self.views]

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
