"""Python's garbage collector, run between inner steps instead of whenever allocation counts say.

Python's cyclic collector starts a collection after a number of allocations, wherever the program is. In a
training step that is in the middle of launching kernels: the GPU drains its queue and waits while the
collector walks the heap, and this process's heap is large (torch, transformers, hivemind, pydantic). So the
trainer freezes the heap it built during start-up (:func:`gc.freeze`: those objects are never scanned again),
turns automatic collection off, and collects at a fixed inner-step interval instead, where one collection
costs the same every time. ``--gc-interval 0`` leaves Python's automatic collection on.
"""

from __future__ import annotations

import gc


class GcSchedule:
    """Automatic collection off while the trainer runs; a full collection every ``interval`` steps."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = gc.isenabled()
        if interval > 0:
            gc.collect()
            gc.freeze()
            gc.disable()

    def collect_if_due(self, step: int) -> None:
        """A full collection at every ``interval``-th step (the frozen start-up heap is not scanned)."""
        if self.interval > 0 and step % self.interval == 0:
            gc.collect()

    def close(self) -> None:
        """Python's automatic collection back as it was (a run called in-process, as tests do)."""
        if self.interval > 0:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
