"""The request lifecycle: what the scheduler half knows of each request vLLM admitted, and which of
its blocks are still to be saved.

vLLM tells the connector about a request through hooks that arrive in orders one step can mix:
admitted (``update_state_after_alloc``), preempted (``preempted_req_ids``, reported at the next
``schedule()``, possibly after the request was already re-admitted when a reset preempted it
outside ``schedule()``), resumed, finished or aborted (``request_finished``, possibly before the
preemption was reported). Instead of trusting the order of the hooks, every decision reads vLLM's
own record of the request: ``request.num_preemptions`` tells whether a preemption happened that
this half has not applied yet (applied exactly once, whichever hook sees it first) and
``request.status`` tells whether vLLM waits for a load (``LoadTracker.emit``).

Saves (invariant 9, never read freed or overwritten blocks):

* eager mode: each step, the full blocks that step's forward completes are saved in that step's
  plan, gathered right after the forward is launched, before vLLM can reuse them.
* lazy mode: the ids of the full blocks computed so far are remembered; when the request is
  preempted or finishes they are flushed, gathered at the start of the next step before anything
  else touches the cache. A finished request's blocks are held (``delay_free``) until that flush is
  dispatched; a preempted request's blocks were freed by vLLM already, but nothing can overwrite
  them before the next step's flush (loads and the forward come after it on every host). With
  several KV cache groups a flush is the request's span of every group's remembered ids, and only
  the groups that keep their blocks until the finish may be saved from it (``step_saves.py``:
  a sliding-window group drops blocks while the request runs; those are saved eagerly,
  ``lazy_spans``).

A preemption keeps a request's save progress (its first blocks were saved or deliberately skipped
already, and recomputing them gives the same content), except when the connector was reset since:
then everything the request computes after its preemption is new and saved from its first block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpuoffload.manager.events import Origin

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

BlockIdsOf = Callable[[str], Sequence]
#: A request's blocks to save: (the request, its block ids as ``KVCacheGroups.ours`` gives them,
#: start, full): blocks ``start .. full - 1``.
Span = tuple["Request", Sequence, int, int]


@dataclass(slots=True)
class RequestRecord:
    """What the scheduler half keeps of one admitted request: vLLM's request, the blocks already dealt
    with (``watermark``), the preemptions applied, and in lazy mode the full blocks computed so
    far."""

    request: "Request"
    # Blocks [0, watermark) were saved, found held, skipped or flushed: never considered again
    # (until a preemption after a connector reset makes the request recompute them).
    watermark: int = 0
    # request.num_preemptions already applied here.
    preemptions: int = 0
    # Lazy mode: the request's block ids (``KVCacheGroups.ours``: one list, or one per KV cache
    # group) cut to its first ``computed`` full blocks, the full blocks computed so far (up to the
    # save limit).
    computed_block_ids: Sequence = ()
    computed: int = 0
    # Lazy mode with several KV cache groups: blocks [0, eager) of the groups saved in the step of
    # their forward were dealt with (``lazy_spans``).
    eager: int = 0


class RequestLifecycle:
    """Every admitted request's save progress, and the step's save candidates (the module docstring
    gives the rules): eager saves in the step of the forward, preempted and finished requests'
    blocks flushed once, finished requests held until their flush is dispatched (invariant 9)."""

    def __init__(self, block_size: int, *, lazy: bool, save_decode_blocks: bool) -> None:
        self.block_size = block_size
        self.lazy = lazy
        self.save_decode_blocks = save_decode_blocks
        self._records: dict[str, RequestRecord] = {}
        self._saving: set[str] = set()  # requests that may still have blocks to save (or track)
        self._flush: list[Span] = []  # lazy: the spans of the next plan's flush
        self._release: list[str] = []  # finished requests to release in the next plan
        self._awaiting_release: set[str] = set()  # released by the workers' finished_sending

    # ------------------------------------------------------------------ gauges
    def num_held(self) -> int:
        """Requests this half keeps a record of (running, waiting after admission, or finished and
        waiting for their flush to be released)."""
        return len(self._records)

    def num_awaiting_release(self) -> int:
        return len(self._awaiting_release)

    def num_pending(self) -> int:
        """Flush candidates and releases not yet planned (zero right after a plan)."""
        return sum(full - start for _, _, start, full in self._flush) + len(self._release)

    def get(self, req_id: str) -> RequestRecord | None:
        return self._records.get(req_id)

    # ------------------------------------------------------------------ vLLM's view
    def admit(self, request: "Request") -> RequestRecord:
        """vLLM allocated blocks for ``request`` (a new admission or a resumption)."""
        rec = self._records.get(request.request_id)
        if rec is None:
            rec = self._records[request.request_id] = RequestRecord(request, preemptions=request.num_preemptions)
            self._saving.add(request.request_id)
        else:
            self._catch_up(rec)
        return rec

    def preempted(self, req_ids: Iterable[str]) -> None:
        """vLLM reports these requests preempted since the last plan (in this schedule() or before
        it, e.g. by a reset); some may already be admitted again, or finished."""
        for req_id in req_ids:
            rec = self._records.get(req_id)
            if rec is not None:
                self._catch_up(rec)

    def _catch_up(self, rec: RequestRecord) -> None:
        """Apply a preemption vLLM made that this half has not applied yet (exactly once): lazy
        mode flushes what the request computed before it (vLLM freed those blocks, but nothing
        overwrites them before the next plan's flush is gathered)."""
        n = rec.request.num_preemptions
        if n <= rec.preemptions:
            return
        rec.preemptions = n
        if self.lazy:
            self._queue_flush(rec)
            rec.computed_block_ids, rec.computed = (), 0
        self._saving.add(rec.request.request_id)

    def finish(self, request: "Request", block_ids: list[int], load_in_flight: bool) -> bool:
        """vLLM finished or aborted ``request`` and passes the blocks it still holds. Returns
        delay_free: True when vLLM must hold the blocks until a flush of them is dispatched
        (invariant 9: a finished request's blocks are held until their save is dispatched)."""
        req_id = request.request_id
        rec = self._records.get(req_id)
        if rec is None:
            return False
        self._catch_up(rec)
        delay = False
        if self.lazy and rec.computed > rec.watermark:
            if load_in_flight:
                # vLLM itself holds the blocks until the load is reported, and frees them then: a
                # second hold would free them twice. Nothing was computed since the load anyway.
                rec.computed_block_ids, rec.computed = (), 0
            else:
                self._queue_flush(rec)
                if block_ids:  # still held by vLLM (not already freed by a preemption)
                    self._release.append(req_id)
                    self._awaiting_release.add(req_id)
                    delay = True
        if not delay:
            self._forget(req_id)
        return delay

    def released(self, req_ids: Iterable[str]) -> set[str]:
        """The workers dispatched the flushes of these finished requests (finished_sending).
        Returns those this half awaited (the rest are another DP rank's, or unknown)."""
        mine = {req_id for req_id in req_ids if req_id in self._awaiting_release}
        for req_id in mine:
            self._awaiting_release.discard(req_id)
            self._forget(req_id)
        return mine

    def _forget(self, req_id: str) -> None:
        self._records.pop(req_id, None)
        self._saving.discard(req_id)

    # ------------------------------------------------------------------ per-step candidates
    def step_candidates(self, so: "SchedulerOutput",
                        block_ids_of: BlockIdsOf) -> tuple[list[int], list[list[bytes]], list[Origin]]:
        """Eager mode: the full blocks this step's forward completes, request by request, planned in
        this step so the workers gather them right after the forward, before vLLM can reuse the
        blocks (invariant 9). Returns (their block ids, their hashes as runs: one list per request,
        to be read in order; a request's own list when all of it is new, so no hash is copied;
        where each run comes from). Requests with nothing left to save stop being visited, so
        decode steps cost nothing."""
        blocks: list[int] = []
        runs: list[list[bytes]] = []
        origins: list[Origin] = []
        for rec, full, _ in self._filled(so):
            start = rec.watermark
            if full > start:
                ids = block_ids_of(rec.request.request_id)
                hashes = rec.request.block_hashes
                blocks += ids[start:full] if start or full < len(ids) else ids
                runs.append(hashes[start:full] if start or full < len(hashes) else hashes)
                origins.append((rec.request, start, full - start, 0))
                rec.watermark = full
        return blocks, runs, origins

    def step_spans(self, so: "SchedulerOutput") -> list[tuple["Request", int, int, bool]]:
        """``step_candidates`` for several KV cache groups (manager/kv_groups.py): per request, the
        request, the span ``start .. full - 1`` of blocks to save, whose ids the caller reads per
        group, and whether this step's forward ends exactly at block ``full`` (where a GDN state
        is saved: ``KVCacheGroups.state_ids``)."""
        spans = []
        for rec, full, end in self._filled(so):
            start = rec.watermark
            if full > start:
                spans.append((rec.request, start, full, end == full * self.block_size))
                rec.watermark = full
        return spans

    def track_computed(self, so: "SchedulerOutput", block_ids_of: BlockIdsOf) -> None:
        """Lazy mode: remember the ids of the full blocks each scheduled request has computed once
        this step's forward ran, for a flush at its finish or preemption."""
        for rec, full, _ in self._filled(so):
            if full > rec.computed:
                rec.computed_block_ids, rec.computed = block_ids_of(rec.request.request_id)[:full], full

    def lazy_spans(self, so: "SchedulerOutput",
                   block_ids_of: BlockIdsOf) -> list[tuple["Request", Sequence[Sequence[int]], int, int, bool]]:
        """Lazy mode with several KV cache groups: ``track_computed`` (every group's ids, each cut
        to the full blocks), and per request ``step_spans`` with the request's block ids per group,
        for the groups whose blocks are saved in the step of their forward (step_saves.py), with
        their own progress (``RequestRecord.eager``, never behind ``computed``)."""
        spans = []
        for rec, full, end in self._filled(so):
            if full <= rec.computed:  # then full <= rec.eager too: nothing new
                continue
            ids = block_ids_of(rec.request.request_id)
            rec.computed_block_ids, rec.computed = [g[:full] for g in ids], full
            if full > rec.eager:
                spans.append((rec.request, ids, rec.eager, full, end == full * self.block_size))
                rec.eager = full
        return spans

    def take_flush(self) -> list[Span]:
        """Lazy mode: the spans queued for the next plan's flush, in the order they were queued."""
        out, self._flush = self._flush, []
        return out

    def take_release(self) -> tuple[str, ...]:
        out, self._release = tuple(self._release), []
        return out

    # ------------------------------------------------------------------ reset
    def forget_unsaved(self) -> None:
        """Connector reset: KV computed before it must never be saved after it. Queued flushes are
        dropped (their releases stay, so vLLM still gets its blocks back). A request preempted by
        the same reset (not applied yet) recomputes everything: its saves start from its first
        block, and what it computed before is never flushed. Any other request's blocks computed
        so far count as handled."""
        self._flush = []
        for rec in self._records.values():
            n = rec.request.num_preemptions
            if n > rec.preemptions:
                rec.preemptions = n
                rec.computed_block_ids, rec.computed = (), 0
                rec.watermark = rec.eager = 0
                self._saving.add(rec.request.request_id)
            else:
                rec.watermark = max(rec.watermark, rec.computed)

    # ------------------------------------------------------------------ internals
    def _queue_flush(self, rec: RequestRecord) -> None:
        full = rec.computed
        if full > rec.watermark:
            self._flush.append((rec.request, rec.computed_block_ids, rec.watermark, full))
            rec.watermark = full

    def _filled(self, so: "SchedulerOutput"):
        """(record, full, end) for each scheduled request that may still have blocks to save,
        ``full`` being its full blocks once this step's forward ran (capped by the save limit and by
        the hashes vLLM has computed), ``end`` its computed tokens then."""
        done = []
        bs = self.block_size
        no_limit = 1 << 62 if self.save_decode_blocks else 0  # else: prompt blocks only
        # In the scheduler's order (running requests first, then new ones), never in the set's:
        # when host RAM cannot take every candidate, this order decides whose blocks get the slots,
        # and a set's order of strings changes with every process's hash seed.
        for req_id, n_sched in so.num_scheduled_tokens.items():
            if req_id not in self._saving:
                continue
            rec = self._records[req_id]
            req = rec.request
            self._catch_up(rec)  # a preemption no hook reported yet is applied first
            limit = no_limit or req.num_prompt_tokens // bs
            end = req.num_computed_tokens + n_sched
            full = min(end // bs, limit, len(req.block_hashes))
            yield rec, full, end
            if full >= limit:
                done.append(req_id)
        self._saving.difference_update(done)

