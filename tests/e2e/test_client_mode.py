"""``--hv.client-mode``: a cluster nobody can dial trains as a client of the all-reduce (on 127.0.0.1 here;
tests/wan puts it behind a NAT). It sends its Δ and copies the reducers' averages, so rounds stay bitwise
identical; a galaxy of clients only cannot form a round and says so."""

from __future__ import annotations

import pytest

from open_diloco.local_galaxy import outer_records

pytestmark = pytest.mark.e2e

ROUNDS = ["--max-steps", "20", "--hv.local-steps", "4"]


def test_a_client_mode_cluster_trains_in_sync_with_a_reachable_one(galaxy):
    reachable = galaxy.start_cluster(0, 2, *ROUNDS)
    client = galaxy.start_cluster(1, 2, *ROUNDS, "--hv.client-mode")
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 300) == 0, galaxy.log(f"cluster{rank}")[-3000:]
    rounds = [outer_records(reachable), outer_records(client)]
    assert sorted(rounds[0]) == sorted(rounds[1]) == [1, 2, 3, 4, 5]
    together = [s for s in rounds[0] if rounds[0][s]["galaxy_peers"] == rounds[1][s]["galaxy_peers"] == 2]
    assert len(together) >= 4, {
        s: (rounds[0][s]["galaxy_peers"], rounds[1][s]["galaxy_peers"]) for s in rounds[0]
    }
    for step in together:
        assert rounds[0][step]["param_hash"] == rounds[1][step]["param_hash"]
        assert rounds[0][step]["in_sync"] and rounds[1][step]["in_sync"]
        # the client sends its whole buffer to the reducers and takes every average back
        assert rounds[1][step]["bytes_sent"] > 0 and rounds[1][step]["bytes_received"] > 0


def test_a_galaxy_of_clients_only_refuses_in_one_line(galaxy):
    for rank in (0, 1):
        galaxy.start_cluster(rank, 2, *ROUNDS, "--hv.client-mode")
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 120) != 0
        log = galaxy.log(f"cluster{rank}")
        assert "all 2 clusters of the galaxy run with --hv.client-mode" in log, log[-3000:]
