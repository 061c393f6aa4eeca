"""A round's floor on real hivemind (127.0.0.1): the fewest peers a group may close with
(``MatchmakingPlan.min_group``, ``outer/quorum.smallest_group``), and its lowering once the records that set
it have expired (``galaxy/paced_matchmaking.lower_floor_later``). Peers and :class:`Galaxy`:
tests/support/averager_peers.py (each test ends every process it started, by PID)."""

from __future__ import annotations

import pytest

from tests.e2e import test_averager
from tests.support.averager_peers import CTX, start_galaxy

galaxy = test_averager.galaxy  # the fixture: every peer's process ended and accounted for, by PID

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def test_a_group_smaller_than_its_floor_keeps_looking_until_the_floor_is_lowered(galaxy):
    """Two peers of a galaxy of four: with the floor at 2 they close their pair when the window ends; with
    it at a majority (3: what ``quorum.smallest_group`` sets while more than half the roster is alive) they
    keep looking through windows, and close the pair only once the averager lowers the floor, after the
    records' expiry (``--hv.member-expiry`` past the window), as a side of a real split must."""
    # the window is BASE's --hv.matchmaking-time (loopback's round trips plan less)
    n, window, expiry = 2, 2.0, 6.0
    barrier = CTX.Barrier(n + 1)
    settings = dict(
        galaxy_size=4, heartbeat_interval=1.0, member_expiry=expiry, averaging_timeout=25.0, min_groups=[2, 3]
    )
    galaxy.start(0, 2, barrier, initial_peers=[], **settings)
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    galaxy.start(1, 2, barrier, initial_peers=maddrs, **settings)
    galaxy.wait_for("ready", n)
    formed = []
    for round_id in range(2):
        barrier.wait(60)
        results = [m for m in galaxy.wait_for("round", n * (round_id + 1), timeout=60) if m[2] == round_id]
        assert not [m for m in galaxy.messages if m[0] == "round_error"]
        assert [r[3]["group_size"] for r in results] == [n] * n, [r[3] for r in results]
        assert len({r[4]["sha256"] for r in results}) == 1, "peers disagree on the averaged bytes"
        formed.append(max(r[3]["matchmaking_seconds"] for r in results))
    assert formed[0] < expiry, formed  # the floor at 2: the pair closed at the window's end
    assert formed[1] >= expiry + window - 0.5, formed  # at 3: not before the floor came down


def test_peers_that_came_first_with_a_longer_window_join_the_later_ones(galaxy):
    """Four peers of a galaxy of four, floor 3: the first two plan the ceiling's window (they saw a cluster
    behind: ``MatchmakingPlan``'s ``coming``), the two that come 3-4 s later the usual short one, so the later
    ones declare the earlier expiries, the better leaders. hivemind re-read the key only while its best known
    leader could still be beaten, so the early pair never heard of the later one: it ended alone at the
    averaging timeout while the later pair closed after the floor came down (each round, every time; the
    `home` soak of 2026-12-04 held rounds a minute that way). With the refresh
    (``paced_matchmaking.refresh_leaders``) the four form one group as the last one arrives."""
    n, arrive_after = 4, [0.0, 0.5, 3.0, 4.0]
    barrier = CTX.Barrier(n + 1)
    settings = dict(
        heartbeat_interval=1.0, averaging_timeout=25.0, min_groups=[3], windows=[25.0, 25.0, 2.4, 2.4]
    )
    start_galaxy(galaxy, n, 1, barrier, arrive_after=arrive_after, **settings)
    barrier.wait(60)
    results = galaxy.wait_for("round", n, timeout=60)
    assert not [m for m in galaxy.messages if m[0] == "round_error"]
    assert [r[3]["group_size"] for r in sorted(results, key=lambda r: r[1])] == [n] * n, [
        r[3] for r in results
    ]
    assert len({r[4]["sha256"] for r in results}) == 1, "peers disagree on the averaged bytes"
    # the group closed when the last one came, not at a window's or the floor's end
    waited = {r[1]: r[3]["matchmaking_seconds"] for r in results}
    assert all(waited[rank] < 4.0 - arrive_after[rank] + 3.0 for rank in range(n)), waited
