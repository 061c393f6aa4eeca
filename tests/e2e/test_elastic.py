"""An elastic galaxy on real clusters: clusters started without ``--hv.world-rank`` are known by an id kept in
their checkpoint directory, form the galaxy with its first round, and join and leave it by ledger entries."""

from __future__ import annotations

import json
import signal
import time

import pytest

from open_diloco.cluster_id import rank_of
from open_diloco.local_galaxy import outer_records, read_metrics
from tests.support.faults import paced

pytestmark = pytest.mark.e2e

QUICK = ["--hv.matchmaking-time", "1.0", "--hv.heartbeat-interval", "1", "--hv.member-expiry", "4"]
COMMON = ["--max-steps", "5000", "--hv.local-steps", "3", "--hv.on-partial-round", "proceed", *QUICK]
"""Runs the test ends (Ctrl+C) once it has seen enough, paced like a device (``paced``)."""


def _start_record(metrics) -> dict:
    return json.loads(metrics.read_text().splitlines()[0])


def _entries(metrics_files) -> dict[int, dict]:
    """Every ledger entry the clusters' sync records hold, by round."""
    return {
        r["ledger"]["round"]: r["ledger"]
        for m in metrics_files
        for r in outer_records(m).values()
        if r.get("ledger")
    }


def _wait_for_entry(galaxy, metrics_files, names, test, seconds: float = 240.0) -> int:
    """The first round whose ledger entry passes ``test``, waited for while the clusters ``names`` run."""
    deadline = time.monotonic() + seconds
    while True:
        found = [n for n, e in sorted(_entries(metrics_files).items()) if test(e)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, _entries(metrics_files)
        assert all(galaxy.procs[name].poll() is None for name in names), [
            galaxy.log(n)[-2000:] for n in names
        ]
        galaxy.track()
        time.sleep(1.0)


def _ranks(entry: dict) -> set[int]:
    return {member["rank"] for member in entry["members"]}


def test_clusters_without_a_rank_form_a_galaxy_a_third_joins_by_an_entry_and_one_leaves(galaxy):
    names = ("alpha", "beta", "gamma")
    metrics = {
        name: galaxy.start_cluster(None, 2, *COMMON, nproc=1, name=name, env=paced(0.2)) for name in names[:2]
    }
    galaxy.wait_for_step(metrics["beta"], 6, 240)
    metrics["gamma"] = galaxy.start_cluster(None, 2, *COMMON, nproc=1, name="gamma", env=paced(0.2))
    # each is known by the id kept in its checkpoint directory, and ranked by it
    ranks = {}
    for name in names:
        galaxy.wait_for_step(metrics[name], 1, 240)
        cluster_id = (galaxy.workdir / f"{name}-ckpt" / "cluster_id").read_text().strip()
        hv = _start_record(metrics[name])["config"]["hv"]
        assert hv["cluster_id"] == cluster_id and hv["world_rank"] == rank_of(cluster_id), hv
        ranks[name] = hv["world_rank"]
    assert len(set(ranks.values())) == 3
    a, b, c = (ranks[name] for name in names)
    files = list(metrics.values())
    # gamma joins the roster with the first entry it is a member of
    joined = _wait_for_entry(galaxy, files, names, lambda e: c in _ranks(e))
    # alpha leaves with Ctrl+C: it says it ended, and the next entries' roster is the two others
    galaxy.procs["alpha"].send_signal(signal.SIGINT)
    assert galaxy.wait("alpha", 60) != 0
    galaxy.track()
    left = _wait_for_entry(
        galaxy, files, names[1:], lambda e: e["round"] > joined and set(e["roster"]) == {b, c}
    )
    _wait_for_entry(galaxy, files, names[1:], lambda e: e["round"] > left)
    for name in names[1:]:
        galaxy.procs[name].send_signal(signal.SIGINT)
        assert galaxy.wait(name, 60) != 0
    entries = _entries(files)
    # the first round is the galaxy's genesis: alpha and beta, both needed (--hv.galaxy-size 2)
    assert set(entries[1]["roster"]) == _ranks(entries[1]) == {a, b}, entries[1]
    assert c in entries[joined]["roster"] and c not in entries[joined - 1]["roster"], entries[joined]
    assert any(set(e["roster"]) == {a, b, c} for e in entries.values()), entries
    # every round is bitwise identical among the clusters in it; gamma is in sync from its first round in
    rounds = {name: outer_records(metrics[name]) for name in names}
    for number, entry in entries.items():
        members = [name for name in names if ranks[name] in _ranks(entry)]
        hashes = {rounds[name][number]["param_hash"] for name in members if number in rounds[name]}
        assert hashes == {entry["after"]}, (number, members, hashes)
    assert rounds["gamma"][joined]["in_sync"], rounds["gamma"][joined]
    for name in names[:2]:  # (gamma starts from the galaxy's θ)
        losses = [r["loss"] for r in read_metrics(metrics[name])]
        assert losses[-1] < 0.8 * losses[0], name
