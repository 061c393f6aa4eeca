"""The averaging steps alive in an averager's process, so that a round's settings end the steps of the rounds
before it first (:meth:`StepTracking.end_earlier_steps`).

Why: a round the trainer gave up on (cancelled: the galaxy committed it without this cluster, or everyone
else left) can leave its hivemind step running. The cancel reaches the averager's process through a pipe, and
a step between two searches on a loaded host, or one that already had a group, went on. Given the next round's
key, it declared itself there and was met in that round's place, with the old round's metadata: the other
cluster's reducers left this one out as stale, and it re-synced instead of committing (the lost-average
test of tests/e2e/test_galaxy.py, 1–2 runs in 9 under load). The trainer starts a round only when the one
before it ended, so a step still alive when the next round's settings arrive is such a leftover."""

from __future__ import annotations

import asyncio
from typing import Any


class StepTracking:
    """Mixed into a ``DecentralizedAverager``: it records each ``_step`` task while it runs."""

    async def _step(self, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        steps = self.__dict__.setdefault("_live_steps", set())
        steps.add(task)
        try:
            return await super()._step(**kwargs)  # type: ignore[misc]
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
