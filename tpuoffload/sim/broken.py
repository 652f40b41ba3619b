"""Deliberately broken engines, used only by the negative-control tests: they prove the pod-slice
harness catches the bugs this project exists to prevent, so a green run means something."""

from __future__ import annotations

import random
import threading
import time

from tpuoffload.worker.transfer_engine import TransferEngine

# How the pod-slice harness catches each (tests/test_podslice.py):
#   host_order           the per-step dispatch digests differ (DigestMismatch names the step and op);
#   background_dispatch  the ops land at a moment that depends on each host's timing: the digests
#                        differ, or ops appear outside the connector hooks that may dispatch
#                        (MisplacedDispatch, a DigestMismatch); the test accepts nothing else.
#   shard0_payloads      a tier turns any rank's slot rows into the pieces of batch shard 0's devices
#                        (what one scheduler's tiers did): under DPScheduler another rank's published
#                        objects hold other bytes, verified, and the slice that loads them reads wrong
#                        context positions (tests/test_dp_shared.py).
VARIANTS = ("host_order", "background_dispatch", "shard0_payloads")


def break_engine(engine: TransferEngine, how: str, host: int) -> None:
    save = engine.save
    if how == "host_order":
        # Host 1 issues its gathers in a different block order (e.g. a host-local dict order).
        if host == 1:
            engine.save = lambda caches, b, s, i: save(caches, b[::-1], s[::-1], i[::-1])
    elif how == "background_dispatch":
        # Gather + device_put dispatched from a background thread, at a moment that depends on
        # each host's timing.
        rng = random.Random(host)
        engine._check_owner = lambda: None

        def background_save(caches, b, s, i):
            def run():
                time.sleep(rng.uniform(0, 0.05))
                save(caches, b, s, i)
            threading.Thread(target=run, daemon=True).start()

        engine.save = background_save
    elif how == "shard0_payloads":
        to_payloads = engine.rows_to_payloads
        engine.rows_to_payloads = lambda rows, shard=0: to_payloads(rows, 0)
    else:
        raise ValueError(f"unknown broken variant {how!r}")


def announce_while_saving(offload) -> None:
    """KV events negative control (tests/test_events.py): the host-RAM index announces a chunk as
    soon as it is named for a save (SAVING), not once every host confirmed it (READY); a save that
    then fails or expires is never withdrawn."""
    events = offload.index.events
    record = events.record

    def record_and_announce(slots, positions, origins):
        record(slots, positions, origins)
        real_ready(slots, offload.index.save_ids(slots))

    real_ready = events.ready
    events.record = record_and_announce
    events.ready = lambda slots, save_ids: None
