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

and the hit length is one every group can serve. Saves skip the null block (a sliding-window
block vLLM already dropped), so only blocks a later hit can use are saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tpuoffload.manager.hash_table import HashKeys, PackedHashes

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tpuoffload.manager.index import ChunkIndex

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


@dataclass(frozen=True)
class KVCacheGroups:
    """vLLM's KV cache groups, in vLLM's order. ``windows[g]``: the blocks a hit of group ``g``
    needs, ending at the hit boundary (sliding window), or None (full attention: all of them)."""

    windows: tuple[int | None, ...] = (None,)

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

    def describe(self) -> str:
        return ", ".join(f"group {g}: " + ("full attention" if w is None else f"sliding window of {w} blocks")
                         for g, w in enumerate(self.windows))

    @classmethod
    def of(cls, kv_cache_config: "KVCacheConfig", block_size: int) -> "KVCacheGroups":
        """The groups of vLLM's KV cache config. Raises ValueError naming a group kind this
        connector cannot offload."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        groups = kv_cache_config.kv_cache_groups
        if len(groups) <= 1:
            return cls()  # one group, whatever its kind: chunks as before HMA
        windows: list[int | None] = []
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            if spec.block_size != block_size:
                raise ValueError(f"KV cache group {g} has blocks of {spec.block_size} tokens, not {block_size}")
            if isinstance(spec, SlidingWindowSpec):
                # The blocks vLLM keeps for a hit of h tokens: those its window does not skip
                # (SlidingWindowManager.get_num_skipped_tokens), the window's blocks ending at h.
                keep = spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)
                windows.append(-(-keep // block_size))
            elif isinstance(spec, FullAttentionSpec):
                windows.append(None)
            else:
                raise ValueError(f"KV cache group {g} ({type(spec).__name__}, layers {group.layer_names[:3]}) "
                                 "cannot be offloaded by tpuoffload: full-attention and sliding-window groups can")
        return cls(tuple(windows) or (None,))

    # ------------------------------------------------------------------ saves
    def candidates(self, spans: Sequence[tuple[Sequence[Sequence[int]], Sequence[bytes], int, int]]
                   ) -> tuple[list[int], PackedHashes]:
        """Save candidates of several groups: for each span (the request's block ids per group,
        its block hashes, start, full), blocks ``start .. full - 1`` of every group, block by block
        (so a staging cut keeps whole early prefixes of every group), keyed by hash and group; the
        null block (a sliding-window block vLLM already dropped) is skipped."""
        G = self.num
        ids = np.array([[b for block_ids, _, start, full in spans for b in block_ids[g][start:full]]
                        for g in range(G)], dtype=np.int64).T  # (n, G)
        if not ids.size:
            return [], PackedHashes(b"", 16)
        packed = PackedHashes.of_runs([hashes[start:full] for _, hashes, start, full in spans])
        words = np.frombuffer(packed.buf, dtype="<u8").reshape(len(packed), packed.width // 8)
        keys = np.repeat(words[:, None, :], G, axis=1)  # (n, G, width/8)
        for g in range(1, G):
            _key_words(keys[:, g], g)
        real = ids != NULL_BLOCK
        return ids[real].tolist(), PackedHashes(keys[real].tobytes(), packed.width)

    # ------------------------------------------------------------------ hits
    def find_hit(self, index: "ChunkIndex", hashes: Sequence[bytes], local: int, stop: int) -> GroupedHit:
        """The longest hit beyond vLLM's ``local`` blocks, up to block ``stop``, that every group
        can serve from READY chunks (see the module doc); no effect on the index."""
        if stop <= local:
            return NO_HIT
        key = self.probe_key(hashes[local])
        if key is not None and index.ready_slot(key) < 0:
            return NO_HIT  # the usual answer, in one probe
        ready = self.ready_slots(index, hashes[local:stop])
        n = self.hit_length([r >= 0 for r in ready])
        if n <= 0:
            return NO_HIT
        first = self.first_blocks(n)
        slots = tuple(ready[g][first[g]:n] for g in range(self.num))
        return GroupedHit(n, first, slots, tuple(index.save_ids(s) for s in slots))

    def probe_key(self, block_hash: bytes) -> bytes | None:
        """The key of the first full-attention group's chunk of this block (None: no such group).
        A hit through the block needs that chunk, so one lookup of it answers most misses."""
        full = [g for g, w in enumerate(self.windows) if w is None]
        return chunk_hash(block_hash, full[0]) if full else None

    def ready_slots(self, index: "ChunkIndex", hashes: Sequence[bytes]) -> list[np.ndarray]:
        """Per group, the READY slot of each block's chunk in ``index`` (-1: none)."""
        packed = PackedHashes.of(hashes)
        return [index.ready_slots(HashKeys.of(chunk_keys(packed, g))) for g in range(self.num)]

    def first_blocks(self, n: int) -> tuple[int, ...]:
        """Per group, the first of a hit's ``n`` blocks it loads (its window's start, or 0)."""
        return tuple(0 if w is None else max(0, n - w) for w in self.windows)

    def hit_length(self, available: Sequence[np.ndarray]) -> int:
        """The longest hit every group can serve, given per group whether each block's chunk is
        available (bool arrays of one length): a full-attention group needs all of its blocks, a
        sliding-window group its window ending at the hit boundary."""
        n = len(available[0])
        for g, w in enumerate(self.windows):
            if w is None:
                miss = np.flatnonzero(~available[g][:n])
                n = int(miss[0]) if len(miss) else n
        while n > 0:  # each sliding-window group may shorten it; shorter is fine for full groups
            m = min((self._window_hit(available[g], w, n) for g, w in enumerate(self.windows) if w is not None),
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
