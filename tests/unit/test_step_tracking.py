"""``galaxy/step_tracking.py``: a round's settings end the averaging steps of earlier rounds still running
(a cancelled round's step that went on searching was met in the next round's place)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from open_diloco.galaxy.step_tracking import StepTracking


class Searching:
    """Stands for hivemind's averager: its step searches until it is cancelled, as a leftover did."""

    ended: list[str]

    async def _step(self, *, name: str) -> str:
        try:
            while True:
                await asyncio.sleep(0.01)
        finally:
            self.ended.append(name)


class Averager(StepTracking, Searching):
    def __init__(self):
        self.ended = []


def test_the_steps_still_running_are_ended_and_counted_and_finished_ones_are_forgotten():
    async def scenario():
        averager = Averager()
        leftover = asyncio.create_task(averager._step(name="round 2, attempt 1"))
        await asyncio.sleep(0.05)
        assert await averager.end_earlier_steps(timeout=1.0) == 1
        assert leftover.cancelled() and averager.ended == ["round 2, attempt 1"]
        assert await averager.end_earlier_steps(timeout=1.0) == 0  # nothing left running: nothing to end

    asyncio.run(scenario())


class Step:
    """Stands for hivemind's ``StepControl``: done once the trainer cancelled it."""

    def __init__(self, cancelled: bool):
        self._cancelled = cancelled

    def done(self) -> bool:
        return self._cancelled


class FinishingLate:
    """Stands for hivemind's averager whose all-reduce ends after the trainer cancelled the step: setting the
    result of the cancelled future raises (``MPFuture.set_result``), as in the chaos soak's logs."""

    async def _step(self, *, step: Step) -> None:
        raise concurrent.futures.InvalidStateError("Can't set_result to a future that is CANCELLED")


class LateAverager(StepTracking, FinishingLate):
    pass


def test_a_step_cancelled_while_it_averaged_ends_quietly_and_any_other_invalid_state_still_raises():
    async def scenario():
        averager = LateAverager()
        assert await averager._step(step=Step(cancelled=True)) is None
        with pytest.raises(concurrent.futures.InvalidStateError):
            await averager._step(step=Step(cancelled=False))
        assert not averager.__dict__["_live_steps"]  # forgotten either way

    asyncio.run(scenario())
