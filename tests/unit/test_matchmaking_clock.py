"""The matchmaking clock (``open_diloco/outer/matchmaking.py``): each round's window, join-request wait and
group size, from the link's round trips and the galaxy's own whole rounds."""

from __future__ import annotations

import pytest

from open_diloco.outer.matchmaking import MatchmakingClock, MatchmakingPlan, percentile
from open_diloco.outer.protocols import Membership


def test_with_nothing_measured_the_plan_is_the_flags():
    plan = MatchmakingClock(floor=2.0, ceiling=30.0).plan(live_clusters=3)
    assert plan == MatchmakingPlan(window=2.0, request_timeout=1.0, group_size=3)


def test_the_window_follows_whole_rounds_and_ignores_partial_ones():
    clock = MatchmakingClock(floor=2.0, ceiling=30.0)
    for seconds in (2.0, 3.0, 4.0, 5.0, 6.0, 3.5, 4.5, 2.5, 5.5, 3.0):
        clock.observe_round(seconds, whole=True)
    clock.observe_round(29.0, whole=False)  # waited the window out for a cluster that never came
    assert clock.plan(4).window == pytest.approx(1.5 * 5.5)  # the 90th percentile of the whole ones
    fast = MatchmakingClock(floor=2.0, ceiling=30.0)
    for _ in range(10):
        fast.observe_round(0.2, whole=True)  # a LAN: the flag stays the least a round waits
    assert fast.plan(4).window == 2.0


def test_the_window_never_passes_its_ceiling():
    clock = MatchmakingClock(floor=2.0, ceiling=10.0)
    for _ in range(5):
        clock.observe_round(40.0, whole=True)
    assert clock.plan(2).window == 10.0


def test_the_window_covers_twenty_round_trips_before_any_round_formed():
    clock = MatchmakingClock(floor=2.0, ceiling=30.0)
    for _ in range(10):
        clock.observe_round_trip(0.15)  # intercontinental
    assert clock.plan(4).window == pytest.approx(3.0)
    for _ in range(10):
        clock.observe_round(5.0, whole=True)
    assert clock.plan(4).window == pytest.approx(7.5)


def test_a_join_request_waits_the_old_rule_or_four_round_trips_and_a_retransmission():
    clock = MatchmakingClock(floor=2.0, ceiling=30.0)
    for rtt in [0.15] * 9 + [0.40]:  # one slow answer in ten is the 90th percentile's business
        clock.observe_round_trip(rtt)
    assert clock.round_trip() == 0.15
    # a 3 s window (20 round trips): the old rule's half of it, above 4 round trips + a retransmission (1.1 s)
    assert clock.plan(2).request_timeout == pytest.approx(1.5)
    for _ in range(5):
        clock.observe_round(6.0, whole=True)
    assert clock.plan(2).request_timeout == pytest.approx(
        3.0
    )  # the old rule's ceiling: a loaded host's answer
    lossy = MatchmakingClock(floor=2.0, ceiling=30.0)
    for _ in range(10):
        lossy.observe_round_trip(0.9)  # a satellite hop: the round trips win
        lossy.observe_round(8.0, whole=True)
    assert lossy.plan(2) == MatchmakingPlan(
        window=18.0, request_timeout=pytest.approx(4 * 0.9 + 0.5), group_size=2
    )
    for bad in (float("nan"), -1.0, float("inf")):
        lossy.observe_round_trip(bad)
        lossy.observe_round(bad, whole=True)
    assert len(lossy.round_trips) == len(lossy.formed) == 10


class TwoRanks:
    """A cluster of two ranks for ``MatchmakingPlan.agreed``: ``min_int`` sees the other rank's value."""

    def __init__(self, other: MatchmakingPlan):
        self.others = iter(
            [
                -round(other.window * 1000),
                -round(other.request_timeout * 1000),
                -other.group_size,
                0 if other.waits_for_behind else 1,
                -other.min_group,
            ]
        )

    def min_int(self, value: int) -> int:
        return min(value, next(self.others))


def test_the_cluster_runs_the_longest_plan_any_rank_made():
    ours = MatchmakingPlan(window=2.0, request_timeout=1.6, group_size=3)
    theirs = MatchmakingPlan(window=7.5, request_timeout=1.1, group_size=3)
    assert ours.agreed(TwoRanks(theirs).min_int) == MatchmakingPlan(7.5, 1.6, 3)


def test_the_cluster_closes_no_group_smaller_than_the_largest_floor_any_rank_planned():
    ours = MatchmakingPlan(window=2.0, request_timeout=1.0, group_size=4, min_group=2)
    theirs = MatchmakingPlan(window=2.0, request_timeout=1.0, group_size=4, min_group=3)
    assert ours.agreed(TwoRanks(theirs).min_int).min_group == 3
    # never above the group that makes it full
    two = MatchmakingPlan(window=2.0, request_timeout=1.0, group_size=2, min_group=3)
    assert two.agreed(TwoRanks(two).min_int).min_group == 2


def test_percentile_is_a_sample_not_an_interpolation():
    assert percentile([], 0.9) is None
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([float(i) for i in range(1, 11)], 0.9) == 9.0
    assert percentile([float(i) for i in range(1, 11)], 0.5) == 5.0


def test_a_cluster_on_its_way_from_an_earlier_round_is_waited_for_up_to_the_ceiling():
    """A cluster that took the last round's state (12-20 s over `home`) arrives late: the window waits the
    ceiling for it (the group still forms the moment it joins), the join request waits as usual, and such a
    round's matchmaking, which measures the late cluster, does not teach the clock."""
    clock = MatchmakingClock(floor=2.0, ceiling=30.0)
    usual = clock.plan(4)
    waiting = clock.plan(4, coming=True)
    assert waiting.window == 30.0 and waiting.waits_for_behind and not usual.waits_for_behind
    assert waiting.request_timeout == usual.request_timeout and waiting.group_size == 4
    assert not usual.agreed(TwoRanks(usual).min_int).waits_for_behind
    # one rank read a late cluster, the other did not: the cluster waits for it, on every shard
    assert usual.agreed(TwoRanks(waiting).min_int) == waiting.agreed(TwoRanks(usual).min_int) == waiting


def test_a_cluster_still_in_an_earlier_round_is_behind_and_a_gone_one_is_not_in_the_view():
    view = Membership(attempts={0: (7, 0), 1: (6, 1), 2: (7, 1), 3: (5, 0)})
    assert view.behind(7, galaxy_rank=0) == {1, 3}
    assert view.behind(7, galaxy_rank=1) == {3}  # never itself
    assert view.behind(6, galaxy_rank=0) == {3}
