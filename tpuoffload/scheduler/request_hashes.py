"""Each request's block hashes, packed once when vLLM adds the request.

Why: a lookup that hits and a step's saves read runs of a request's block hashes. Read from vLLM's
list, every hash is its own Python object, and by the time the connector's hooks run vLLM's own
step has evicted them from the CPU caches: a cache miss per hash (a prefill step saves about 512).
When vLLM adds a request it has just computed its prompt's hashes, so they are in cache: packing
them then (``on_new_request``) costs about a microsecond per request, and every later read is a
slice of one contiguous buffer.

Contract: ``packed(request, start, stop)`` always equals
``PackedHashes.of(request.block_hashes[start:stop])``. vLLM changes its list in two ways only: it
appends hashes as blocks fill, and a streaming session deletes a tail of the list and appends
newly computed hashes (new objects). So the packed positions are unchanged exactly while the list
still holds, at the last packed position, the very object that was packed (held here, so no other
object can take its identity); otherwise the copy is dropped for good. Hashes past the packed ones
(decode blocks) are read from vLLM's list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from tpuoffload.scheduler.hash_table import PackedHashes

if TYPE_CHECKING:
    from vllm.v1.request import Request


class _Packed(NamedTuple):
    buf: bytes
    width: int
    n: int  # hashes packed
    last: object  # vLLM's hash object at position n - 1 (held: no other object can take its identity)


class RequestHashes:
    """Single-threaded (vLLM's scheduler thread). Entries live from ``add`` to ``forget``."""

    def __init__(self) -> None:
        self._by_req: dict[str, _Packed] = {}

    def __len__(self) -> int:
        return len(self._by_req)

    def add(self, request: "Request") -> None:
        """vLLM added ``request`` (its prompt's hashes were just computed)."""
        hashes = request.block_hashes
        if len(hashes):
            p = PackedHashes.of(hashes)
            self._by_req[request.request_id] = _Packed(p.buf, p.width, len(hashes), hashes[-1])

    def forget(self, req_id: str) -> None:
        self._by_req.pop(req_id, None)

    def packed(self, request: "Request", start: int, stop: int) -> PackedHashes:
        """``PackedHashes.of(request.block_hashes[start:stop])``, from the packed copy where it holds."""
        hashes = request.block_hashes
        entry = self._by_req.get(request.request_id)
        if entry is not None and start < entry.n:
            buf, w, n, last = entry
            if len(hashes) >= n and hashes[n - 1] is last:
                if stop <= n:
                    packed = PackedHashes(buf, w)
                    return packed if start == 0 and stop == n else packed.slice(start, stop)
                tail = PackedHashes.of(hashes[n:stop])
                if tail.width == w:
                    return PackedHashes(buf[start * w:] + tail.buf, w)
            else:  # vLLM replaced hashes the copy holds: never use it again
                del self._by_req[request.request_id]
        return PackedHashes.of(hashes[start:stop])

    def packed_runs(self, runs: Sequence[tuple["Request", int, int]]) -> PackedHashes:
        """The hashes of ``(request, start, stop)`` runs, one after the other, packed."""
        if len(runs) == 1:
            request, start, stop = runs[0]
            return self.packed(request, start, stop)
        parts = [self.packed(request, start, stop) for request, start, stop in runs]
        width = parts[0].width
        if all(p.width == width for p in parts):
            return PackedHashes(b"".join([p.buf for p in parts]), width)
        # Hashes of several widths (not vLLM's): normalise as PackedHashes.of does.
        return PackedHashes.of([h for request, start, stop in runs for h in request.block_hashes[start:stop]])
