"""The averaging steps alive in an averager's process, so that a round's settings end the steps of the rounds
before it first (:meth:`StepTracking.end_earlier_steps`).

Why: a round the trainer gave up on (cancelled: the galaxy committed it without this cluster, or everyone
else left) can leave its hivemind step running. The cancel reaches the averager's process through a pipe, and
a step between two searches on a loaded host, or one that already had a group, went on. Given the next round's
key, it declared itself there and was met in that round's place, with the old round's metadata: the other
cluster's reducers left this one out as stale, and it re-synced instead of committing (the lost-average
test of tests/e2e/test_galaxy.py, 1–2 runs in 9 under load). The trainer starts a round only when the one
before it ended, so a step still alive when the next round's settings arrive is such a leftover.

A step cancelled while its all-reduce ran still finishes the all-reduce, and hivemind then sets the result
of a future already cancelled: ``InvalidStateError`` from the step's task, which nobody awaits, so asyncio
logged it as an ERROR with two tracebacks ("Task exception was never retrieved", 8 times in a 4 × 2 `home`
chaos soak) for a result nobody wanted. That case ends the step quietly."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any


class StepTracking:
    """Mixed into a ``DecentralizedAverager``: it records each ``_step`` task while it runs."""

    async def _step(self, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        steps = self.__dict__.setdefault("_live_steps", set())
        steps.add(task)
        try:
            return await super()._step(**kwargs)  # type: ignore[misc]
        except concurrent.futures.InvalidStateError:
            step = kwargs.get("step")
            if step is None or not step.done():
                raise
            return None  # the round was given up on (cancelled) before its all-reduce ended
        finally:
            steps.discard(task)

    async def end_earlier_steps(self, timeout: float) -> int:
        """Cancel every step still running and wait for them to end (``timeout`` at most); how many there
        were. A cancelled step leaves hivemind's retry loop (its future is done) and its search's ``finally``
        blocks run."""
        earlier = [task for task in self.__dict__.get("_live_steps", ()) if not task.done()]
        for task in earlier:
            task.cancel()
        if earlier:
            await asyncio.wait(earlier, timeout=timeout)
        return len(earlier)
