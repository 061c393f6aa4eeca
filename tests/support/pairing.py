"""The suite's xdist scheduler: a test that mostly waits goes beside one that keeps the CPU busy.

The suite runs on two workers on a two-core machine. Some tests spend most of their wall time waiting (the
WAN lab's forwarders, the averager's peers between rounds, clusters paced to a device's step time), others
keep one to two cores busy (a galaxy of trainer ranks). xdist hands tests out in queue order, so two waiting
tests often ran side by side: the first five minutes of the suite kept the machine 40-60 % busy (the WAN lab
on one worker, then the averager's 30 tests on both). This scheduler is xdist's ``loadgroup`` (a group's
tests still run on one worker, one after another) with one change: a worker asking for work gets the first
unit in the queue whose kind differs from what the other worker is running now, when there is one, else the
first unit.

The controller knows tests only by node id, so the waiting ones are named by node-id prefix
(:data:`tests.conftest.WAITING`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from xdist.scheduler import LoadGroupScheduling


def waits(nodeid: str, waiting: Iterable[str]) -> bool:
    """Whether a test mostly waits: its node id starts with one of the ``waiting`` prefixes."""
    return nodeid.startswith(tuple(waiting))


def pick(queue: OrderedDict[str, dict[str, bool]], other_waits: bool | None, waiting: Iterable[str]) -> str:
    """The scope to hand out next: the first one of the other kind than the other worker's current test
    (``other_waits``; None when it runs nothing), else the first one."""
    first = next(iter(queue))
    if other_waits is None:
        return first
    for scope, unit in queue.items():
        if waits(next(iter(unit)), waiting) != other_waits:
            return scope
    return first


class PairingScheduling(LoadGroupScheduling):
    """``loadgroup`` that pairs a waiting test with a busy one (module docstring)."""

    def __init__(self, config, log=None, *, waiting: Iterable[str] = ()) -> None:
        super().__init__(config, log)
        self.waiting = tuple(waiting)

    def _running_waits(self, node) -> bool | None:
        """Whether ``node``'s current test (its first unfinished one) waits; None when it has none."""
        for unit in self.assigned_work.get(node, {}).values():
            for nodeid, done in unit.items():
                if not done:
                    return waits(nodeid, self.waiting)
        return None

    def _assign_work_unit(self, node) -> None:
        others = [self._running_waits(other) for other in self.assigned_work if other is not node]
        other_waits = next((kind for kind in others if kind is not None), None)
        scope = pick(self.workqueue, other_waits, self.waiting)
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)
