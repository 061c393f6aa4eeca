"""Membership does not depend on two sites' clocks agreeing (issue 34, point 8): a cluster whose clock is 100
s behind stays a member of the galaxy from its first round, and each side names the other's skew in one
line."""

from __future__ import annotations

import pytest

from open_diloco.local_galaxy import outer_records
from tests.support.faults import fault_env

pytestmark = pytest.mark.e2e


def _skewed_clock(seconds: float) -> dict[str, str]:
    """The environment of a cluster whose status clock runs ``seconds`` off
    (``faults/skewed_status_clock``)."""
    return fault_env("skewed_status_clock", OPEN_DILOCO_TEST_STATUS_SKEW=seconds)


def test_a_cluster_whose_clock_is_100_s_behind_stays_in_the_galaxy(galaxy):
    # before: cluster 0 read cluster 1's records as 100 s old (expiry 4 s) and ran every round alone-minded
    common = [
        "--max-steps",
        "24",
        "--hv.local-steps",
        "3",
        "--hv.averaging-timeout",
        "20",
        "--hv.heartbeat-interval",
        "1",
        "--hv.member-expiry",
        "4",
    ]
    metrics = [
        galaxy.start_cluster(0, 2, *common, nproc=1),
        galaxy.start_cluster(1, 2, *common, nproc=1, env=_skewed_clock(-100.0)),
    ]
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 300) == 0, galaxy.log(f"cluster{rank}")[-3000:]
    rounds = [outer_records(m) for m in metrics]
    assert sorted(rounds[0]) == sorted(rounds[1]) == list(range(1, 9)), rounds
    assert all(side[r]["galaxy_alive"] == 2 for side in rounds for r in side), rounds
    assert rounds[0][8]["param_hash"] == rounds[1][8]["param_hash"]
    for name in ("cluster0", "cluster1"):
        assert "clusters alive" not in galaxy.log(name)  # no change of the live set, ever
    behind = [line for line in galaxy.log("cluster0").splitlines() if "cluster 1's clock is" in line]
    ahead = [line for line in galaxy.log("cluster1").splitlines() if "cluster 0's clock is" in line]
    assert len(behind) == 1 and " s behind this one's" in behind[0], behind
    assert len(ahead) == 1 and " s ahead of this one's" in ahead[0], ahead
