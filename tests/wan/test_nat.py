"""Clusters behind a NAT in the WAN lab (``scripts/wan/nat.py``: outbound masqueraded, everything that starts
outside dropped), with a reachable DHT.

Needs root, iproute2 and nftables (the lab installs nftables from Debian's packages when it is missing);
skipped elsewhere with one line."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest

from open_diloco.local_galaxy import Galaxy, kill_tree, outer_records
from scripts.wan.lab import Lab
from scripts.wan.namespaces import LabError
from scripts.wan.nat import ensure_nft
from tests.wan.test_wan import _wait_until_together, assert_gone, lab_pids

pytestmark = [pytest.mark.wan, pytest.mark.xdist_group("wan")]


@pytest.fixture(scope="module")
def nft():
    if os.geteuid() != 0 or not all(map(shutil.which, ("ip", "tc"))):
        pytest.skip("the WAN lab's NAT needs root and iproute2")
    try:
        ensure_nft()
    except LabError as err:
        pytest.skip(str(err))


def wait_for_line(galaxy: Galaxy, name: str, pattern: str, seconds: float) -> str | None:
    """The first line of ``name``'s log matching ``pattern`` within ``seconds``, or None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = re.search(pattern, galaxy.log(name), re.MULTILINE)
        if found:
            return found.group(0)
        time.sleep(0.5)
    return None


def test_a_cluster_behind_a_nat_trains_in_sync_is_told_it_cannot_be_dialled_and_rejoins(nft, tmp_path):
    """One cluster behind a NAT, one reachable (acceptance (1), (3) and (4) of issue 38): rounds are bitwise
    identical; the NATed cluster reduces its span over the connections it opened (it receives the other's
    part of its span each round); its reachability check names its address as not reachable within 30 s of
    starting, the reachable one's says reachable (with --hv.auto-client-mode, which leaves it a reducer);
    killed and started again with --hv.auto-client-mode, the NATed cluster rejoins as a client."""
    steps = [
        "--max-steps", "2000", "--hv.local-steps", "5", "--hv.averaging-timeout", "20",
        "--hv.heartbeat-interval", "1", "--hv.member-expiry", "4",
    ]  # fmt: skip
    with Lab(2, "region", nat=["c1"]) as lab:
        pids = lab_pids(lab)
        galaxy = Galaxy(tmp_path, lab=lab)
        try:
            metrics = [galaxy.start_cluster(0, 2, *steps, "--hv.auto-client-mode", nproc=1)]
            launched = time.monotonic()
            metrics.append(galaxy.start_cluster(1, 2, *steps, nproc=1))
            # (3): the NATed cluster hears that its own address cannot be dialled, within the check's 30 s
            # (plus the trainer's start-up here: imports and the DHT, ~10 s on two loaded cores)
            line = wait_for_line(galaxy, "cluster1", r"not reachable at /ip4/10\.78\.1\.2/tcp/\d+.*$", 60)
            told_after = time.monotonic() - launched
            assert line is not None, galaxy.log("cluster1")[-3000:]
            assert "--hv.client-mode" in line and "--hv.announce-maddrs" in line, line
            assert wait_for_line(
                galaxy, "cluster0", r"rank 0: reachable at /ip4/10\.77\.0\.10/tcp/\d+", 30
            ), galaxy.log("cluster0")[-3000:]
            assert "joins as a client" not in galaxy.log("cluster0")

            # (1): four rounds in sync, the NATed cluster a reducer like the other
            galaxy.wait_for_step(metrics[1], 5 * 5, 180)
            rounds = [outer_records(m) for m in metrics]
            shared = sorted(set(rounds[0]) & set(rounds[1]))[:4]
            assert len(shared) == 4, (sorted(rounds[0]), sorted(rounds[1]))
            for r in shared:
                a, b = rounds[0][r], rounds[1][r]
                assert a["param_hash"] == b["param_hash"] and a["galaxy_peers"] == b["galaxy_peers"] == 2, (
                    a,
                    b,
                )
                # a reducer receives the other cluster's part of its span: half the Δ, like cluster 0
                assert b["bytes_received"] > 0.4 * a["bytes_received"] > 0, (a, b)

            # (4): killed (as a lost node would be) and started again, it rejoins the galaxy
            galaxy.track()
            kill_tree(galaxy.procs["cluster1"].pid)
            killed_at = max(outer_records(metrics[1]))
            del galaxy.procs["cluster1"]
            again = galaxy.start_cluster(
                1, 2, *steps, "--hv.auto-client-mode", nproc=1, name="cluster1-again"
            )
            together = _wait_until_together(galaxy, [metrics[0], again], after=killed_at, seconds=180)
            assert together is not None, galaxy.log("cluster1-again")[-3000:]
            assert together <= min(outer_records(again)) + 2, (together, sorted(outer_records(again)))
            assert "joins as a client of the all-reduce (--hv.auto-client-mode)" in galaxy.log(
                "cluster1-again"
            )
        finally:
            galaxy.close()
        pids += sorted(galaxy.seen_pids)
    assert_gone(lab, pids)
    print(
        f"the NATed cluster was told it cannot be dialled {told_after:.1f} s after its launch; "
        f"rejoined at round {together}"
    )


# slow: most of it is the check's 30 s window; the dial-back itself is tests/e2e/test_reachability.py's
@pytest.mark.slow
def test_two_clusters_behind_nats_are_told_that_no_round_can_form(nft, tmp_path):
    """Two clusters behind NATs and a reachable DHT (acceptance (2) of issue 38): neither can open a
    connection to the other, so no round forms (relays carried nothing in the lab: docs/networks.md). Each
    says so in one line within the check's 30 s, naming what to open, and both stop cleanly when asked."""
    steps = ["--max-steps", "2000", "--hv.local-steps", "5", "--hv.averaging-timeout", "10"]
    with Lab(2, "region", nat=["c0", "c1"]) as lab:
        pids = lab_pids(lab)
        galaxy = Galaxy(tmp_path, lab=lab)
        try:
            for rank in (0, 1):
                galaxy.start_cluster(rank, 2, *steps, nproc=1)
            for rank in (0, 1):
                line = wait_for_line(galaxy, f"cluster{rank}", r"could not be dialled from here.*$", 75)
                assert line is not None, galaxy.log(f"cluster{rank}")[-3000:]
                assert "no round can form" in line and "open its port" in line, line
        finally:
            galaxy.close()
        pids += sorted(galaxy.seen_pids)
    assert_gone(lab, pids)
