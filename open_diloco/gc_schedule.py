"""Python's garbage collector, run between inner steps instead of whenever allocation counts say.

Python's cyclic collector starts a collection after a number of allocations, wherever the program is. In a
training step that is in the middle of launching kernels: the GPU drains its queue and waits while the
collector walks the heap, and this process's heap is large (torch, transformers, hivemind, pydantic). So the
trainer freezes the heap it built during start-up (:func:`gc.freeze`: those objects are never scanned again),
turns automatic collection off, and collects at a fixed inner-step interval instead, where one collection
costs the same every time. ``--gc-interval 0`` leaves Python's automatic collection on.

A process forked while the schedule runs (hivemind's DHT and averagers, data-loader workers) inherits
automatic collection off, but runs no steps to collect at: each turns it back on as it starts
(:func:`os.register_at_fork`), or its cyclic garbage (asyncio futures, tracebacks, streams) would never be
freed.
"""

from __future__ import annotations

import gc
import os

_scheduled = False
"""Whether a schedule has automatic collection off in this process; a forked child reads its parent's."""


def _collect_automatically_in_child() -> None:
    if _scheduled:
        gc.enable()


os.register_at_fork(after_in_child=_collect_automatically_in_child)


class GcSchedule:
    """Automatic collection off while the trainer runs; a full collection every ``interval`` steps."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = gc.isenabled()
        if interval > 0:
            gc.collect()
            gc.freeze()
            gc.disable()
            _set_scheduled(True)

    def collect_if_due(self, step: int) -> None:
        """A full collection at every ``interval``-th step (the frozen start-up heap is not scanned)."""
        if self.interval > 0 and step % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        """Python's automatic collection back as it was (a run called in-process, as tests do)."""
        if self.interval > 0:
            _set_scheduled(False)
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()


def _set_scheduled(value: bool) -> None:
    global _scheduled
    _scheduled = value
