"""``--hv.client-mode``: a cluster nobody can dial trains as a client of the all-reduce. It sends its Δ and
copies the reducers' averages, so rounds stay bitwise identical (the averager alone:
tests/e2e/test_averager.py; a client joining a galaxy late: tests/e2e/test_unequal_clusters.py); a galaxy of
clients only cannot form a round and says so."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

ROUNDS = ["--max-steps", "20", "--hv.local-steps", "4"]


def test_a_galaxy_of_clients_only_refuses_in_one_line(galaxy):
    for rank in (0, 1):
        galaxy.start_cluster(rank, 2, *ROUNDS, "--hv.client-mode", nproc=1)  # the galaxy is the subject
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 120) != 0
        log = galaxy.log(f"cluster{rank}")
        assert "all 2 clusters of the galaxy run with --hv.client-mode" in log, log[-3000:]
