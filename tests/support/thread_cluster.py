"""The ranks of one cluster as threads: a ``ClusterComm`` whose collectives really gather across them, so the
outer loop's agreement (every rank takes the same decision through the same collectives) is tested without a
process group. A rank that skips a collective its siblings enter makes the barrier time out: the test fails,
as the real cluster would hang."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from open_diloco.outer.cluster import ClusterComm

BARRIER_SECONDS = 20.0


class ThreadCluster:
    """``ranks`` ranks; :meth:`comm` gives each its ``ClusterComm``; :meth:`run` runs one function per
    rank."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self._barrier = threading.Barrier(ranks, timeout=BARRIER_SECONDS)
        self._slots: list[Any] = [None] * ranks

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)

    def gather(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        gathered = list(self._slots)
        self._barrier.wait()  # nobody writes the next collective's value before everyone read this one's
        return gathered

    def run(self, work: Callable[[int, ThreadComm], Any]) -> list[Any]:
        """``work(rank, comm)`` on every rank at once; their results in rank order (an exception is
        re-raised)."""
        results: list[Any] = [None] * self.ranks
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            try:
                results[rank] = work(rank, self.comm(rank))
            except BaseException as err:  # noqa: BLE001 - handed to the test's thread
                errors.append(err)
                self._barrier.abort()

        threads = [threading.Thread(target=one, args=(rank,)) for rank in range(self.ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        if errors:
            raise errors[0]
        return results


class ThreadComm(ClusterComm):
    """One rank's ``ClusterComm`` (same methods, same meaning; what ClusterComm derives from its collectives,
    such as ``norm``, it inherits)."""

    def __init__(self, cluster: ThreadCluster, rank: int):
        super().__init__("cpu")
        self.cluster, self.rank = cluster, rank

    def min_int(self, value: int) -> int:
        return int(min(self.cluster.gather(self.rank, int(value))))

    def all_true(self, value: bool) -> bool:
        return self.min_int(int(value)) == 1

    def sum_float(self, value: float) -> float:
        return float(sum(self.cluster.gather(self.rank, float(value))))

    def gather_strings(self, value: str) -> list[str]:
        return self.cluster.gather(self.rank, value)

    def broadcast_strings(self, values: list[str]) -> list[str]:
        return self.cluster.gather(self.rank, values)[0]
