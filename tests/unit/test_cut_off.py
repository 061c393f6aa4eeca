"""The rule that stops a cluster cut off from another at start (``galaxy/cut_off.py``), on a fake clock and
fake pings; the WAN lab's two NATed clusters (``tests/wan/test_nat.py``, slow tier) run it for real."""

from __future__ import annotations

import pytest

from open_diloco.galaxy import cut_off
from open_diloco.galaxy.cut_off import CUT_OFF, KNOWN_SECONDS, CutOffWatch
from open_diloco.membership_record import MemberRecord


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world(monkeypatch):
    clock, answering = Clock(), set()
    monkeypatch.setattr(cut_off.time, "monotonic", clock)
    monkeypatch.setattr(cut_off, "_answering", lambda _dht, peers: {p for p in peers if p in answering})
    return clock, answering


def record(rank: int, state: str = "training") -> MemberRecord:
    return MemberRecord(galaxy_rank=rank, shard_peer_ids=[f"peer{rank}"], state=state)


def watch_for(watch: CutOffWatch, clock: Clock, records, seconds: float, gone=frozenset(), step: float = 2.0):
    """Read the membership every ``step`` s for ``seconds``; the first line it gives, and when."""
    end = clock.now + seconds
    while clock.now < end:
        if line := watch.line(records, gone, averaged=False):
            return line, clock.now
        clock.now += step
    return None, clock.now


def test_a_live_cluster_unanswered_for_30_s_after_a_whole_check_stops_this_one(world):
    clock, _ = world
    watch, start = CutOffWatch(None, 0, 0, member_expiry=4.0), clock.now
    line, at = watch_for(watch, clock, [record(0), record(1)], 200)
    assert line is not None and CUT_OFF in line and "[1]" in line and "open one cluster's port" in line
    assert at - start >= KNOWN_SECONDS + 30 and at - start <= KNOWN_SECONDS + 30 + 8


def test_an_answer_a_round_or_a_short_life_keeps_it_training(world):
    clock, answering = world
    watch = CutOffWatch(None, 0, 0, member_expiry=4.0)
    answering.add("peer1")  # reachable either way
    assert watch_for(watch, clock, [record(0), record(1)], 200)[0] is None
    answering.clear()
    assert CutOffWatch(None, 0, 0, 4.0).line([record(1)], frozenset(), averaged=True) is None
    # a cluster that goes quiet (a partition cuts it off the DHT too) stops counting, and starts afresh later
    watch = CutOffWatch(None, 0, 0, member_expiry=4.0)
    assert watch_for(watch, clock, [record(1)], KNOWN_SECONDS + 20)[0] is None
    assert watch.line([record(1)], frozenset({1}), averaged=False) is None
    assert watch_for(watch, clock, [record(1)], 20)[0] is None


def test_the_wait_covers_twice_the_member_expiry(world):
    clock, _ = world
    watch, start = CutOffWatch(None, 0, 0, member_expiry=40.0), clock.now
    _, at = watch_for(watch, clock, [record(1)], 300)
    assert at - start >= KNOWN_SECONDS + 80


def test_the_other_side_stopping_for_this_reason_stops_this_one_at_once(world):
    clock, _ = world
    watch = CutOffWatch(None, 0, 0, member_expiry=4.0)
    assert watch_for(watch, clock, [record(1)], KNOWN_SECONDS + 10)[0] is None  # unanswered for ~10 s
    stopped = [record(1, state=f"failed (this cluster and cluster(s) [0] {CUT_OFF}: ...)")]
    assert CUT_OFF in (watch.line(stopped, frozenset({1}), averaged=False) or "")
    # a cluster that stopped for another reason is not this
    other = CutOffWatch(None, 0, 0, member_expiry=4.0)
    assert watch_for(other, clock, [record(1)], KNOWN_SECONDS + 10)[0] is None
    assert other.line([record(1, state="failed (bad flag)")], frozenset({1}), averaged=False) is None
