"""The galaxy guard's content checks on real clusters: a cluster whose training diverges cannot poison the
others (the reducers' checks on real hivemind, and a stranger refused by the allowlist, are in
test_averager.py and test_membership.py)."""

from __future__ import annotations

import math

import pytest

from open_diloco.local_galaxy import outer_records
from tests.conftest import read_metrics

pytestmark = pytest.mark.e2e


def test_a_diverged_cluster_cannot_poison_a_healthy_one(galaxy):
    # Cluster 1 trains at an absurd lr (10): from its first round its Δ is not finite, or finite but 130x the
    # weights it came from (out of bound from the first round, before any history; measured: rounds 1 and 3).
    # It never sends it: it sits each round out, adopts the healthy cluster's θ_outer, diverges again, and
    # after --hv.max-bad-rounds (3) such rounds in a row stops with one line. Cluster 0 trains on to the end,
    # finite.
    common = [
        "--hv.local-steps",
        "3",
        "--hv.on-partial-round",
        "proceed",
        "--hv.averaging-timeout",
        "5",
        "--hv.heartbeat-interval",
        "1",
        "--hv.member-expiry",
        "4",
    ]
    healthy = galaxy.start_cluster(0, 2, "--max-steps", "45", *common, nproc=1)
    diverged = galaxy.start_cluster(1, 2, "--max-steps", "400", "--lr", "10", *common, nproc=1)
    assert galaxy.wait("cluster1", 240) != 0
    assert galaxy.wait("cluster0", 240) == 0, galaxy.log("cluster0")[-3000:]

    errors = [line for line in galaxy.log("cluster1").splitlines() if line.startswith("open-diloco: error:")]
    assert errors and "rounds in a row (its training diverges): stopping" in errors[0], errors
    sat_out = list(outer_records(diverged).values())
    assert len(sat_out) == 3, sat_out  # the 4th bad round stopped it before its record
    assert all(
        r["galaxy_peers"] == 0 and False in (r["pseudo_grad_finite"], r["pseudo_grad_in_bound"])
        for r in sat_out
    ), sat_out
    finite_but_wild = [r for r in sat_out if r["pseudo_grad_finite"] and not r["pseudo_grad_in_bound"]]
    assert finite_but_wild, sat_out
    assert any(r["resynced"] for r in sat_out), sat_out  # it healed to the galaxy's θ_outer in between

    records = read_metrics(healthy)
    assert [r["step"] for r in records] == list(range(1, 46))
    assert all(math.isfinite(r["loss"]) for r in records)
    rounds = outer_records(healthy)
    assert sorted(rounds) == list(range(1, 16))
    assert all(math.isfinite(r["param_checksum"]) and r["average_finite"] for r in rounds.values()), rounds
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]
