"""Fault points of the worker's step path, declared by the product and injected from outside.

The transfer engine calls ``FaultInjector.hit`` at each point below. Whatever an injector does
there (sleep, raise, fail some positions), the host still issues exactly the JAX programs the
step's metadata implies, with placeholder data where needed (invariant 2); only what it reports
changes: failed saves are never loadable, failed loads are reported as load errors.

=============  ===============  ========================================================
point          thread           a fault there means
=============  ===============  ========================================================
READ_SLOTS     engine main      reading this host's slots for a load failed / lost slots
H2D            engine main      building the device array from host bytes failed
D2H            background       the device-to-host transfer of a save failed / is slow
WRITE_SLOTS    background       copying a save's bytes into slots failed / lost slots
=============  ===============  ========================================================
"""

from __future__ import annotations

import enum


class FaultPoint(enum.Enum):
    READ_SLOTS = "read_slots"
    H2D = "h2d"
    D2H = "d2h"
    WRITE_SLOTS = "write_slots"


class FaultInjector:
    """The default injector: nothing fails."""

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        """Called at ``point`` for an operation covering ``n`` chunks. May sleep (a slow host),
        raise (the whole operation fails on this host) or return positions ``0..n-1`` that fail
        alone (a lost slot, a short copy)."""
        return set()


NO_FAULTS = FaultInjector()
