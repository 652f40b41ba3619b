"""vLLM's KV cache groups (its hybrid KV cache manager, HMA) as the scheduler half plans with them.

With HMA on, vLLM keeps one block table per KV cache group (layers of one attention type: full
attention, sliding window, ...), all groups drawing block ids from one shared pool. tpu-inference
allocates arrays that each serve one layer of every group (``tpuoffload/layout.py:KVGroupMap``), so
block ``b`` of every array is the KV of group ``g``'s layers when ``b`` is one of ``g``'s blocks. A
chunk is therefore one block of every array, as with one group, and is keyed by the block's content
hash AND its group (``chunk_keys``): the same tokens give one chunk per group.

Not to be confused with ``layout.GroupLayout`` (arrays of one shape, dtype and sharding).

Per group, what a hit needs (``KVCacheGroups.find_hit``), as vLLM's own managers decide it:

* full attention: every block from vLLM's local hit to the hit boundary;
* sliding window: only the blocks of the window that ends at the hit boundary (vLLM allocates
  nothing below it: those block ids are the null block), so a load moves only that tail;
* GDN/mamba state (vLLM's mamba cache mode "align", tpu-inference's compact state pool): the one
  state chunk at the hit boundary, a window of one block. Its chunk is one ROW of every state
  array (the second slot pool, ``pools``), saved only in the step that computes exactly that
  boundary (``state_ids``): the row at column k - 1 holds the state after k blocks only then. The
  other mamba groups mirror the first one's ids (tpu-inference's hybrid coordinator), so their
  layers' rows travel in its chunk: they save and load nothing themselves (a window of 0);

and the hit length is one every group can serve. Saves skip the null block (a sliding-window
block vLLM already dropped), so only blocks a later hit can use are saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from tpuoffload.manager.hash_table import HashKeys, PackedHashes

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tpuoffload.manager.index import ChunkIndex
    from tpuoffload.manager.rank_view import RankView

#: vLLM's null block (block 0 of the pool): a block table entry that holds nothing.
NULL_BLOCK = 0
# Per group, the words XORed into a content hash's two key words (group 0: none, so a one-group
# model's keys, checkpoints and chunk files are its content hashes as before).
_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xC2B2AE3D27D4EB4F)
_EMPTY = np.zeros(0, dtype=np.int64)


def _mix(kv_group: int) -> tuple[np.uint64, np.uint64]:
    g = np.uint64(kv_group)
    with np.errstate(over="ignore"):
        return g * _MIX1, g * _MIX2


def _key_words(words: np.ndarray, kv_group: int) -> None:
    """Turn content-hash words (rows of ``width / 8`` uint64 words, in place) into the keys of
    ``kv_group``'s chunks: the one place a chunk's group enters its key. Group 0 keeps the content
    hash, so a one-group model's keys are what they were before HMA."""
    if kv_group:
        m1, m2 = _mix(kv_group)
        words[..., 0] ^= m1
        words[..., 1] ^= m2


def chunk_keys(packed: PackedHashes, kv_group: int) -> PackedHashes:
    """The keys of the chunks of ``kv_group`` whose blocks have these content hashes."""
    if kv_group == 0 or not len(packed):
        return packed
    words = np.frombuffer(packed.buf, dtype="<u8").reshape(len(packed), packed.width // 8).copy()
    _key_words(words, kv_group)
    return PackedHashes(words.tobytes(), packed.width)


def content_keys(keys: HashKeys, kv_groups: np.ndarray) -> HashKeys:
    """The content-hash keys (group 0's) of chunks whose keys are ``keys``, chunk ``i`` of group
    ``kv_groups[i]``: ``_key_words`` undone (an XOR: its own inverse)."""
    g = np.asarray(kv_groups, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return HashKeys(keys.k1 ^ (g * _MIX1), keys.k2 ^ (g * _MIX2))


def chunk_hash(block_hash: bytes, kv_group: int) -> bytes:
    """``chunk_keys`` of one hash (as a lookup's first probe takes it)."""
    return chunk_keys(PackedHashes.of([block_hash]), kv_group).buf if kv_group else block_hash


@dataclass(frozen=True)
class GroupedHit:
    """A hit every group can serve: ``n`` blocks beyond vLLM's local hit; per group, the first of
    those blocks it loads (0 for full attention, the window's start for a sliding window) and the
    READY slots and save ids of blocks ``first .. n - 1``."""

    n: int
    first: tuple[int, ...] = ()
    slots: tuple[np.ndarray, ...] = ()
    save_ids: tuple[np.ndarray, ...] = ()

    def all_slots(self) -> np.ndarray:
        return np.concatenate(self.slots) if self.slots else _EMPTY


NO_HIT = GroupedHit(0)

#: The slot pools (``KVCacheGroups.pools``): KV chunks (one block of every attention array), and
#: state chunks (one row of every GDN/mamba state array).
KV_POOL, STATE_POOL = 0, 1
#: ``KVCacheGroups.windows`` of a mamba group that mirrors the primary one's ids: nothing of its own.
MIRROR = 0


@dataclass(frozen=True)
class KVCacheGroups:
    """vLLM's KV cache groups, in vLLM's order. ``windows[g]``: the blocks a hit of group ``g``
    needs, ending at the hit boundary (sliding window; 1 for the GDN/mamba state group, ``MIRROR``
    for the mamba groups that mirror it), or None (full attention: all of them). ``pools[g]``: the
    slot pool of group ``g``'s chunks (empty: every group in ``KV_POOL``)."""

    windows: tuple[int | None, ...] = (None,)
    pools: tuple[int, ...] = ()

    @property
    def num(self) -> int:
        return len(self.windows)

    @property
    def several(self) -> bool:
        """More than one group: vLLM then refuses block-level load errors (failures go by request)."""
        return len(self.windows) > 1

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.windows)

    @cached_property
    def held_to_finish(self) -> tuple[bool, ...]:
        """Per group, whether vLLM keeps every block of a request until the request finishes or
        is preempted: full attention only. A sliding-window group frees each block that leaves its
        window while the request runs (``SlidingWindowManager.remove_skipped_blocks``, at every
        ``allocate_slots``), and the GDN state group's row holds a boundary's state only in the
        step that computed it. What a lazy flush may save from ids remembered earlier (step_saves.py)."""
        return tuple(w is None for w in self.windows)

    def ours(self, per_group: Sequence):
        """A request's block ids as the scheduler half keeps them, from vLLM's per-group tuple:
        group 0's list with one group (the one-group path copies nothing), every group's with
        several."""
        return per_group if len(self.windows) > 1 else per_group[0]

    @property
    def num_pools(self) -> int:
        """Slot pools the chunks need: 2 with a GDN/mamba state group, else 1."""
        return 1 + (STATE_POOL in self.pools)

    @cached_property
    def state_group(self) -> int | None:
        """The mamba group whose ids name the state rows (the others mirror it), if any."""
        return next((g for g, p in enumerate(self.pools) if p == STATE_POOL and self.windows[g] != MIRROR), None)

    def describe(self) -> str:
        def kind(g: int, w: int | None) -> str:
            if self.pools and self.pools[g] == STATE_POOL:
                return "GDN/mamba state" + (" (mirrors the state group)" if w == MIRROR else ", one row per hit")
            return "full attention" if w is None else f"sliding window of {w} blocks"

        return ", ".join(f"group {g}: {kind(g, w)}" for g, w in enumerate(self.windows))

    @classmethod
    def of(cls, kv_cache_config: "KVCacheConfig", block_size: int) -> "KVCacheGroups":
        """The groups of vLLM's KV cache config. Raises ValueError naming a group kind this
        connector cannot offload."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

        groups = kv_cache_config.kv_cache_groups
        if len(groups) <= 1:
            return cls()  # one group, whatever its kind: chunks as before HMA
        windows: list[int | None] = []
        pools: list[int] = []
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            if spec.block_size != block_size:
                raise ValueError(f"KV cache group {g} has blocks of {spec.block_size} tokens, not {block_size}")
            pools.append(KV_POOL)
            if isinstance(spec, SlidingWindowSpec):
                # The blocks vLLM keeps for a hit of h tokens: those its window does not skip
                # (SlidingWindowManager.get_num_skipped_tokens), the window's blocks ending at h.
                keep = spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
                windows.append(-(-keep // block_size))
            elif isinstance(spec, FullAttentionSpec):
                windows.append(None)
            elif isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
                pools[-1] = STATE_POOL
                windows.append(MIRROR if STATE_POOL in pools[:-1] else 1)
            else:
                mode = f" in mamba cache mode {spec.mamba_cache_mode!r}" if isinstance(spec, MambaSpec) else ""
                raise ValueError(f"KV cache group {g} ({type(spec).__name__}, layers {group.layer_names[:3]}){mode} "
                                 "cannot be offloaded by tpuoffload: full-attention, sliding-window and GDN/mamba "
                                 "groups in mamba cache mode 'align' (prefix caching on) can")
        if all(p == STATE_POOL for p in pools):
            raise ValueError("every KV cache group holds GDN/mamba state: tpuoffload needs an attention group")
        return cls(tuple(windows), tuple(pools) if STATE_POOL in pools else ())

    def pool_of_groups(self) -> np.ndarray:
        """Per group, its slot pool (int8)."""
        return np.array(self.pools or (KV_POOL,) * self.num, dtype=np.int8)

    def state_ids(self, block_ids: Sequence[Sequence[int]], full: int, exact: bool) -> Sequence[Sequence[int]]:
        """A request's block ids per group as its saves see them at ``full`` full blocks: the state
        group keeps only column ``full - 1``, and only when this step ends exactly at that boundary
        (``exact``: the GDN kernel wrote the state after ``full`` blocks there in this step; any
        other non-null row holds a state of another length), the mirror groups keep nothing. The
        other groups' lists are returned as they are."""
        state = self.state_group
        if state is None:
            return block_ids
        out = list(block_ids)
        nulls = [NULL_BLOCK] * full  # shared by the groups that save nothing (read, never written)
        for g, p in enumerate(self.pools):
            if p == STATE_POOL:
                out[g] = nulls
        if exact and full:
            out[state] = nulls[:-1] + [block_ids[state][full - 1]]
        return out

    # ------------------------------------------------------------------ saves
    def candidates(self, spans: Sequence[tuple[Sequence[Sequence[int]], Sequence[bytes], int, int]]
                   ) -> tuple[list[int], PackedHashes, np.ndarray]:
        """Save candidates of several groups: for each span (the request's block ids per group as
        ``state_ids`` gives them, its block hashes, start, full), blocks ``start .. full - 1`` of
        every group, block by block (so a staging cut keeps whole early prefixes of every group),
        keyed by hash and group; the null block (a sliding-window block vLLM already dropped, a
        state row not saved) is skipped. Returns (block ids, keys, each candidate's slot pool)."""
        G = self.num
        ids = np.array([[b for block_ids, _, start, full in spans for b in block_ids[g][start:full]]
                        for g in range(G)], dtype=np.int64).T  # (n, G)
        if not ids.size:
            return [], PackedHashes(b"", 16), np.zeros(0, np.int8)
        packed = PackedHashes.of_runs([hashes[start:full] for _, hashes, start, full in spans])
        words = np.frombuffer(packed.buf, dtype="<u8").reshape(len(packed), packed.width // 8)
        keys = np.repeat(words[:, None, :], G, axis=1)  # (n, G, width/8)
        for g in range(1, G):
            _key_words(keys[:, g], g)
        real = ids != NULL_BLOCK
        pools = np.broadcast_to(self.pool_of_groups(), ids.shape)[real]
        return ids[real].tolist(), PackedHashes(keys[real].tobytes(), packed.width), pools

    # ------------------------------------------------------------------ hits
    def find_hit(self, index: "ChunkIndex", hashes: Sequence[bytes], local: int, stop: int,
                 view: "RankView | None" = None) -> GroupedHit:
        """The longest hit beyond vLLM's ``local`` blocks, up to block ``stop``, that every group
        can serve from READY chunks (see the module doc); no effect on the index. Under
        DPScheduler, ``view`` (the other ranks' READY chunks) serves each chunk the rank's own
        index lacks, named as a load names it (rank_view.py)."""
        if stop <= local:
            return NO_HIT
        key = self.probe_key(hashes[local])
        if key is not None and index.ready_slot(key) < 0 and not (view is not None and view.holds(key)):
            return NO_HIT  # the usual answer, in one probe
        packed = PackedHashes.of(hashes[local:stop])
        ready = [self._ready(index, view, packed, g, w) for g, w in enumerate(self.windows)]
        n = self.hit_length([held for held, _, _ in ready])
        if n <= 0:
            return NO_HIT
        first = self.first_blocks(n)
        return GroupedHit(n, first, tuple(slots[first[g]:n] for g, (_, slots, _) in enumerate(ready)),
                          tuple(ids[first[g]:n] for g, (_, _, ids) in enumerate(ready)))

    def _ready(self, index: "ChunkIndex", view: "RankView | None", packed: PackedHashes, g: int,
               window: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Group ``g``'s chunks of these blocks: whether each is READY, its slot and its save id
        (the rank's own chunk, else the view's)."""
        n = len(packed)
        if window == MIRROR:
            return np.zeros(n, bool), np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        keys = chunk_keys(packed, g)
        slots = index.ready_slots(HashKeys.of(keys))
        held = slots >= 0
        ids = np.full(n, -1, np.int64)
        ids[held] = index.save_ids(slots[held])
        if view is not None and not held.all():
            lack = np.flatnonzero(~held)
            width = keys.width
            theirs, their_slots, their_ids = view.named([keys.buf[i * width:(i + 1) * width] for i in lack.tolist()])
            slots[lack[theirs]], ids[lack[theirs]] = their_slots[theirs], their_ids[theirs]
            held[lack[theirs]] = True
        return held, slots, ids

    def probe_key(self, block_hash: bytes) -> bytes | None:
        """The key of the first full-attention group's chunk of this block (None: no such group).
        A hit through the block needs that chunk, so one lookup of it answers most misses."""
        full = [g for g, w in enumerate(self.windows) if w is None]
        return chunk_hash(block_hash, full[0]) if full else None

    def ready_slots(self, index: "ChunkIndex", hashes: Sequence[bytes]) -> list[np.ndarray]:
        """Per group, the READY slot of each block's chunk in ``index`` (-1: none)."""
        packed = PackedHashes.of(hashes)
        none = np.full(len(hashes), -1, np.int64)
        return [none if w == MIRROR else index.ready_slots(HashKeys.of(chunk_keys(packed, g)))
                for g, w in enumerate(self.windows)]

    def first_blocks(self, n: int) -> tuple[int, ...]:
        """Per group, the first of a hit's ``n`` blocks it loads (its window's start, or 0; a
        mirror group: none, ``n``)."""
        return tuple(0 if w is None else max(0, n - w) for w in self.windows)

    def hit_length(self, available: Sequence[np.ndarray]) -> int:
        """The longest hit every group can serve, given per group whether each block's chunk is
        available (bool arrays of one length): a full-attention group needs all of its blocks, a
        sliding-window group its window ending at the hit boundary (the state group: the block at
        the boundary), a mirror group nothing."""
        n = len(available[0])
        for g, w in enumerate(self.windows):
            if w is None:
                miss = np.flatnonzero(~available[g][:n])
                n = int(miss[0]) if len(miss) else n
        while n > 0:  # each sliding-window group may shorten it; shorter is fine for full groups
            m = min((self._window_hit(available[g], w, n) for g, w in enumerate(self.windows) if w),
                    default=n)
            if m == n:
                break
            n = m
        return max(n, 0)

    @staticmethod
    def _window_hit(ok: np.ndarray, window: int, n: int) -> int:
        """The largest m <= n whose window (blocks max(0, m - window) .. m - 1) is all available."""
        ok = ok[:n]
        # Length of the run of available blocks ending at each block.
        idx = np.arange(1, n + 1)
        last_miss = np.maximum.accumulate(np.where(ok, 0, idx))
        run = idx - last_miss
        valid = run >= np.minimum(window, idx)
        hits = np.flatnonzero(valid)
        return int(hits[-1]) + 1 if len(hits) else 0
