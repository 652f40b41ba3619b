"""Where each dispatch happened: markers around the connector hooks in every step's dispatch digest
(``mark_hooks``, on the workers) and the check that every dispatch sat inside a hook that may
dispatch (``misplaced_op``, on the driver). Invariant 1's detector for the pod slices."""

from __future__ import annotations

from collections.abc import Sequence


_MARKED_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_transfer_results",
                 "get_block_ids_with_load_errors", "get_kv_connector_stats", "build_connector_worker_meta",
                 "clear_connector_metadata")


_DISPATCHING_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_save")


def misplaced_op(ops: Sequence[str]) -> int | None:
    """Index of the first op (not a hook marker) recorded outside a dispatching hook, or None."""
    open_hook = None
    for i, op in enumerate(ops):
        if op.startswith("> "):
            open_hook = op[2:].strip()
        elif op.startswith("< "):
            open_hook = None
        elif open_hook not in _DISPATCHING_HOOKS:
            return i
    return None


def mark_hooks(connector, runner) -> None:
    """Interleave the connector hooks vLLM calls (and the forward) with the dispatched ops in the
    step's digest. The hooks run on the main thread in an order fixed by the SchedulerOutput, so
    the markers are identical on every host; what they add is *where* each dispatch happened. A
    dispatch issued from a background thread lands between different markers on different hosts
    (its timing is local), so the digests diverge even when the ops themselves are the same."""
    log = lambda: connector.worker.engine.log  # noqa: E731  (the engine exists after register_runner)

    def wrap(obj, name, label):
        fn = getattr(obj, name)

        def marked(*args, **kwargs):
            log().record(f"> {label}")
            try:
                return fn(*args, **kwargs)
            finally:
                if name != "clear_connector_metadata":  # the step's digest is closed by then
                    log().record(f"< {label}")
        setattr(obj, name, marked)

    for name in _MARKED_HOOKS:
        wrap(connector, name, name)
    wrap(runner, "_forward", "forward")
