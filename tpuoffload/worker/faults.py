"""Fault points of the worker's step path, declared by the product and injected from outside.

The transfer engine calls ``FaultInjector.hit`` at each point below. Whatever an injector does
there (sleep, raise, fail some positions), the host still issues exactly the JAX programs the
step's metadata implies, with placeholder data where needed (invariant 2); only what it reports
changes: failed saves are never loadable, failed loads are reported as load errors.

===============  ===============  ========================================================
point            thread           a fault there means
===============  ===============  ========================================================
LOAD_SLOT_CHECK  engine main      checking a load's slots before its programs: slots lost
LOAD_PREPARE     engine main      preparing a load after the checks failed
SAVE_PROGRAM     background       a save's programs failed (or are slow) before they finished
SAVE_RECORD      background       recording a save's chunks in the slot table failed / is slow
===============  ===============  ========================================================
"""

from __future__ import annotations

import enum


class FaultPoint(enum.Enum):
    """The places a fault can be injected into the engine (``FaultInjector.hit``): each turns rows of a
    load into load errors or of a save into failures, never a change of what is dispatched."""

    LOAD_SLOT_CHECK = "load_slot_check"
    LOAD_PREPARE = "load_prepare"
    SAVE_PROGRAM = "save_program"
    SAVE_RECORD = "save_record"


class FaultInjector:
    """The default injector: nothing fails."""

    def hit(self, point: FaultPoint, n: int) -> set[int]:
        """Called at ``point`` for an operation covering ``n`` chunks. May sleep (a slow host),
        raise (the whole operation fails on this host) or return positions ``0..n-1`` that fail
        alone (a lost slot, a short copy)."""
        return set()


NO_FAULTS = FaultInjector()
