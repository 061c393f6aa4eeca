"""A round's floor on real hivemind (127.0.0.1): the fewest peers a group may close with
(``MatchmakingPlan.min_group``, ``outer/quorum.smallest_group``), and its lowering once the records that set
it have expired (``galaxy/paced_matchmaking.lower_floor_later``). Peers and :class:`Galaxy`:
tests/support/averager_peers.py (each test ends every process it started, by PID)."""

from __future__ import annotations

import pytest

from tests.e2e import test_averager
from tests.support.averager_peers import CTX

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
