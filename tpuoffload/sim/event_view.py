"""A router's view of a replica's KV events, rebuilt from the wire, and the connector's own truth.

``EventSubscriber`` is a real ZMQ SUB socket on localhost that vLLM's own ``ZmqEventPublisher``
connects to (as in llm-d's central mode); it decodes each message with vLLM's msgspec types
(``KVEventBatch``) and checks that no sequence number is missing. ``EventView`` applies the batches
the way a router keeps a replica's residency: the set of (block hash, medium, KV cache group) that
the events say the replica can serve, strictly (a hash stored twice on one medium and group, or
removed while absent, is an error: tpuoffload announces each chunk once). It also keeps what vLLM's
own HBM events ("GPU") said of every hash, to check that tpuoffload's events join them: same hash
for the same tokens, with the same parent.

``loadable`` is the connector's own truth: every (hash, medium, group) it would serve right now,
asked of its indexes hash by hash (``ChunkIndex.ready_slot``), not of its event records.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from tpuoffload.manager.events import MEDIUM_CPU, MEDIUM_STORAGE

MEDIUM_GPU = "GPU"


class EventSubscriber:
    """A SUB socket bound on 127.0.0.1 (a free port): point a publisher's ``endpoint`` at
    ``self.endpoint`` (not a bind address, so vLLM's publisher connects to it). With ``connect``
    (``tcp://127.0.0.1:PORT``) it connects there instead, to a publisher that binds (``tcp://*:PORT``),
    e.g. each DPScheduler rank's; connected before the publisher starts, it gets the first batch
    (ZMQ reconnects every 100 ms); ``gaps`` counts any batch missed."""

    def __init__(self, connect: str | None = None) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        if connect is not None:
            self.sock.connect(connect)
            self.endpoint = connect
        else:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.last_seq = -1  # of the current publisher
        self.gaps = 0  # missing sequence numbers

    def recv(self, timeout_s: float):
        """One (seq, KVEventBatch), or None after ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        _topic, seq_bytes, payload = self.sock.recv_multipart()
        return int.from_bytes(seq_bytes, "big"), self._decode(payload)

    def connect(self, publish_probe, timeout_s: float = 20.0) -> None:
        """Publish empty batches through ``publish_probe()`` until one arrives (a PUB drops what it
        sends before the subscription reached it); the sequence starts there."""
        deadline = time.monotonic() + timeout_s
        while True:
            publish_probe()
            got = self.recv(0.05)
            if got is not None:
                self.last_seq = got[0]
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no KV event batch reached {self.endpoint} in {timeout_s:.0f} s")

    def drain_until(self, seq: int, view: "EventView", timeout_s: float = 20.0) -> None:
        """Apply every batch up to sequence number ``seq`` to ``view``, counting missing ones."""
        deadline = time.monotonic() + timeout_s
        while self.last_seq < seq:
            got = self.recv(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise TimeoutError(f"batch {seq} did not arrive (last {self.last_seq})")
            if got[0] != self.last_seq + 1:
                self.gaps += 1
            self.last_seq = got[0]
            view.apply(got[1])

    def close(self) -> None:
        self.sock.close(0)


class EventView:
    """What a replica's events say it can serve, and what they say about each hash."""

    def __init__(self, gpu_blocks: dict | None = None) -> None:
        self.held: set[tuple[object, str, int]] = set()  # (hash, medium, group)
        self.ever: set[tuple[object, str, int]] = set()  # every one announced
        self.errors: list[tuple] = []
        self.stored = {MEDIUM_CPU: 0, MEDIUM_STORAGE: 0}  # hashes announced
        self.removed = {MEDIUM_CPU: 0, MEDIUM_STORAGE: 0}
        self.kinds: dict[int, set[str]] = {}  # group -> the spec kinds its offloaded chunks were announced with
        # hash -> (tokens, parent) from vLLM's HBM events (shared across a restart's views)
        self.gpu_blocks: dict = {} if gpu_blocks is None else gpu_blocks
        self.batches = 0
        self.ranks: set = set()

    def offloaded(self) -> set[tuple[object, str, int]]:
        return {k for k in self.held if k[1] != MEDIUM_GPU}

    def apply(self, batch) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        self.batches += 1
        self.ranks.add(batch.data_parallel_rank)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    key = (h, ev.medium, ev.group_idx)
                    if ev.medium != MEDIUM_GPU:
                        self.removed[ev.medium] += 1
                        if key not in self.held:
                            self.errors.append(("removed while absent", key))
                    self.held.discard(key)
            elif isinstance(ev, AllBlocksCleared):  # vLLM's block pool: its own (HBM) blocks
                self.held = {k for k in self.held if k[1] != MEDIUM_GPU}
            else:
                self.errors.append(("unknown event", type(ev).__name__))

    def _stored(self, ev) -> None:
        bs = ev.block_size
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            tokens = tuple(ev.token_ids[i * bs:(i + 1) * bs])
            key = (h, ev.medium, ev.group_idx)
            if ev.medium == MEDIUM_GPU:
                self.gpu_blocks[h] = (tokens, parent)
            else:
                self.stored[ev.medium] += 1
                if key in self.held:
                    self.errors.append(("stored twice", key))
                if ev.kv_cache_spec_kind not in ("full_attention", "sliding_window", "mamba") or len(tokens) != bs:
                    self.errors.append(("payload", key, ev.kv_cache_spec_kind, len(tokens)))
                self.kinds.setdefault(ev.group_idx, set()).add(ev.kv_cache_spec_kind)
                gpu = self.gpu_blocks.get(h)
                if gpu is None:
                    self.errors.append(("hash unknown to vLLM's HBM events", key))
                elif gpu != (tokens, parent):
                    self.errors.append(("tokens or parent differ from vLLM's HBM event", key))
            self.held.add(key)
            self.ever.add(key)
            parent = h


def loadable(offload, hashes: Iterable[bytes]) -> set[tuple[object, str, int]]:
    """Every (hash as vLLM publishes it, medium, KV cache group) the scheduler half ``offload`` can
    serve now, among ``hashes`` (vLLM's block hashes); raises if an index holds a loadable chunk
    none of them names (the truth would be incomplete)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from tpuoffload.manager.kv_groups import chunk_hash

    ram = offload.index
    disk = offload.tier("disk")
    disk_index = disk.disk.index if disk is not None else None
    out: set[tuple[object, str, int]] = set()
    cpu = storage = 0
    for h in set(hashes):
        for g in range(offload.kv_groups.num):
            key = chunk_hash(h, g)  # the index's key of group g's chunk of these tokens
            if ram.ready_slot(key) >= 0:
                out.add((maybe_convert_block_hash(h), MEDIUM_CPU, g))
                cpu += 1
            if disk_index is not None and disk_index.ready_slot(key) >= 0:
                out.add((maybe_convert_block_hash(h), MEDIUM_STORAGE, g))
                storage += 1
    if cpu != ram.num_ready() or (disk_index is not None and storage != disk_index.num_ready()):
        raise AssertionError(f"loadable chunks of unknown hashes: {cpu}/{ram.num_ready()} in host RAM, "
                             f"{storage}/{disk_index.num_ready() if disk_index else 0} on disk")
    return out
