"""DiLoCo across real clusters: DHT + torchrun clusters x 2 ranks on 127.0.0.1, hivemind all-reduce."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from open_diloco.data_audit import audit
from open_diloco.local_galaxy import outer_records
from open_diloco.sample_log import read_sample_logs
from tests.conftest import kill_tree, read_metrics
from tests.support.faults import fault_env
from tests.support.ledger_checks import assert_one_chain, assert_verifies_and_refuses_an_altered_hash

pytestmark = pytest.mark.e2e


# bf16/int8/int4 share int2's path (and test_averager covers each on the wire): int2 runs through a trainer's
# rounds, stop and resume in test_galaxy_checkpoint, so its case here is slow. sparse is slow too: its rounds
# (the outer loop's selection, what stays local, bitwise) are tests/unit/test_sparse.py's, its wire with the
# block scores over real reducers test_averager's, its state's round trip test_outer_stateful's. fp16 runs in
# test_unequal_clusters.py, whose 2 x 2 galaxy makes the same checks with steps by speed and resumes bit-exact
@pytest.mark.parametrize(
    "compression",
    ["none", pytest.param("int2", marks=pytest.mark.slow), pytest.param("sparse", marks=pytest.mark.slow)],
)
def test_two_clusters_stay_bitwise_identical(galaxy, compression):
    samples = galaxy.workdir / "samples"
    steps = ["--max-steps", "30", "--hv.local-steps", "10", "--hv.compression", compression]
    metrics = [galaxy.start_cluster(rank, 2, *steps, "--sample-log", str(samples)) for rank in (0, 1)]
    for m in metrics:  # a rank starts its hivemind processes before its first step
        galaxy.wait_for_step(m, 1, 120)
    sockets = galaxy.socket_files("cluster0") | galaxy.socket_files("cluster1")
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 300) == 0, galaxy.log(f"cluster{rank}")[-3000:]
    # per rank: its p2pd, its DHT's and its averager's clients (and multiprocessing's listeners); a clean
    # exit leaves none of their files
    assert len([path for path in sockets if path.startswith("/tmp/hivemind-p2p")]) == 3 * 4, sockets
    assert not [path for path in sockets if os.path.exists(path)]
    rounds = [outer_records(m) for m in metrics]
    assert sorted(rounds[0]) == sorted(rounds[1]) == [1, 2, 3]
    for step in (1, 2, 3):
        a, b = rounds[0][step], rounds[1][step]
        assert a["param_hash"] == b["param_hash"], (step, a["param_hash"], b["param_hash"])
        assert a["param_checksum"] == b["param_checksum"]
        assert a["galaxy_peers"] == b["galaxy_peers"] == 2 and a["in_sync"] and b["in_sync"]
        assert a["bytes_sent"] > 0 and a["allreduce_seconds"] > 0
        assert (
            0
            < a["exchange_seconds"]
            <= a["matchmaking_seconds"] + a["exchange_seconds"]
            <= a["allreduce_seconds"]
        )
        assert a["matchmaking_window_seconds"] >= 1.0  # the galaxy fixture's --hv.matchmaking-time: its floor
    # the round trips measured to the other cluster (DHT pings, from the first round on): loopback's
    assert all(0 < rounds[c][3]["round_trip_seconds"] < 1.0 for c in (0, 1)), [rounds[c][3] for c in (0, 1)]
    # the clusters trained on different data, yet share θ; and each one's loss fell
    for m in metrics:
        losses = [r["loss"] for r in read_metrics(m)]
        assert losses[-1] < 0.8 * losses[0]
    assert rounds[0][1]["pseudo_grad_norm"] != rounds[1][1]["pseudo_grad_norm"]
    # the ledger: one entry per round, made by each cluster alone, the same in both; a chain; verified
    assert_one_chain(metrics, [1, 2, 3], members=[0, 1])
    assert_verifies_and_refuses_an_altered_hash(metrics, galaxy.workdir / "ledger")
    # what the loaders handed the models (--sample-log): each cluster's two ranks took its stream's positions
    # 0..239 once each, rank r the r-th 4 of every block of 8, one step after another
    for c in (0, 1):
        lines = [line for line in read_sample_logs(samples) if line["galaxy_rank"] == c]
        for r in (0, 1):
            mine = [line for line in lines if line["rank"] == r]
            assert (
                [line["step"] for line in mine]
                == [line["inner_steps"] for line in mine]
                == list(range(1, 31))
            )
            assert all(
                line["sample_ids"] == [8 * (line["step"] - 1) + 4 * r + i for i in range(4)] for line in mine
            )
    # and what became of them (open-diloco audit-data): every page (step) of each cluster committed once
    audited = audit(samples, metrics)
    assert [(c.cursor, c.once) for c in audited.clusters] == [(30, list(range(1, 31)))] * 2, audited
    assert not audited.problems
    # goodput: every step trained went into a committed round
    for c in (0, 1):
        first, last = rounds[c][1], rounds[c][3]
        assert last["tokens_computed"] == 3 * first["tokens_computed"] > 0, last
        assert last["tokens_committed"] == last["tokens_computed"] and last["goodput"] == 1.0, last


def test_an_average_lost_on_its_way_costs_the_cluster_nothing(galaxy):
    """Cluster 0's reducers never send the last average of round 2 (fault injected: a stream cut short, seen
    under load), so its round is whole and cluster 1's is not. Cluster 1 applies nothing of its own: once
    cluster 0's record shows the round committed (at once, or while it retries), it takes it from cluster 0
    (its own Δ is in it: a commit, nothing re-synced) and both meet round 3 in sync. Before, the retry waited
    for cluster 0's round 3, was left out of it and re-synced after it."""
    # H = 40: cluster 0's next round is seconds away, as in real runs, so the retry's membership poll (every 2
    # s) comes first; with H = 10 here the retry could meet that next round before its first poll
    steps = ["--max-steps", "120", "--hv.local-steps", "40", "--hv.averaging-timeout", "30"]
    fault = _losing_last_average(of_round=2)
    metrics = [
        galaxy.start_cluster(0, 2, *steps, nproc=1, env=fault),
        galaxy.start_cluster(1, 2, *steps, nproc=1),
    ]
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 300) == 0, galaxy.log(f"cluster{rank}")[-3000:]
    rounds = [outer_records(m) for m in metrics]
    shown = _both_clusters_rounds(rounds)
    assert sorted(rounds[0]) == sorted(rounds[1]) == [1, 2, 3], shown
    whole, partial = rounds[0][2], rounds[1][2]
    assert whole["galaxy_peers"] == 2 and whole["galaxy_complete"], shown
    assert partial["round_outcome"] == "adopted" and partial["committed"] and not partial["resynced"], shown
    assert partial["state_source"] == 0 and partial["param_hash"] == whole["param_hash"], shown

    def tails() -> list[str]:  # on a failure only
        return [galaxy.log(f"cluster{rank}")[-2000:] for rank in (0, 1)]

    for step in (1, 3):
        a, b = rounds[0][step], rounds[1][step]
        assert a["galaxy_peers"] == b["galaxy_peers"] == 2 and a["in_sync"] and b["in_sync"], (
            step,
            shown,
            tails(),
        )
        assert a["param_hash"] == b["param_hash"], (step, shown, tails())
    # taken at once when cluster 0's record already showed the round, else after "the galaxy applied this
    # round without this cluster while it looked for a group" in the retry: either way, a commit of the same
    # round
    assert "outer step 2: took the round as cluster 0 committed it" in galaxy.log("cluster1")
    # the adopted round is cluster 0's entry, both clusters' Δ in it
    assert_one_chain(metrics, [1, 2, 3], members=[0, 1])


def test_a_last_round_that_came_short_is_taken_from_the_cluster_that_finished(galaxy):
    """The galaxy's last round: cluster 0's reducers never send the last average of it, so cluster 0 commits
    the round and ends its run while cluster 1's round is partial. A finished cluster is gone from the rounds,
    but it serves its last state while it drains: cluster 1 takes the round from it (its Δ is in it: a commit)
    and the run ends with one θ. Before, cluster 1 found no live cluster to take it from, applied its own Δ
    alone and the galaxy ended split (CI, 2026-11-27)."""
    steps = ["--max-steps", "12", "--hv.local-steps", "6", "--hv.averaging-timeout", "30"]
    metrics = [
        galaxy.start_cluster(0, 2, *steps, nproc=1, env=_losing_last_average(of_round=2)),
        galaxy.start_cluster(1, 2, *steps, nproc=1),
    ]
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 300) == 0, galaxy.log(f"cluster{rank}")[-3000:]
    rounds = [outer_records(m) for m in metrics]
    shown = _both_clusters_rounds(rounds)
    assert sorted(rounds[0]) == sorted(rounds[1]) == [1, 2], shown
    whole, partial = rounds[0][2], rounds[1][2]
    assert whole["galaxy_peers"] == 2 and whole["galaxy_complete"], shown
    assert partial["round_outcome"] == "adopted" and partial["committed"] and not partial["resynced"], shown
    assert partial["state_source"] == 0 and partial["param_hash"] == whole["param_hash"], shown
    assert not any("split" in galaxy.log(f"cluster{rank}") for rank in (0, 1))


@pytest.mark.parametrize(
    "schedule",
    [
        # slow: streaming is the harder case, and test_an_average_lost_on_its_way_costs_the_cluster_nothing
        # takes a lost average's round from the committed cluster in blocking mode
        pytest.param([], id="blocking", marks=pytest.mark.slow),
        # τ = H/P: a fragment is always in flight, so the round that loses an average has the next one started
        # beside it; before, only a poll inside a blocking wait could end the cascade, and it never ran here
        pytest.param(["--hv.fragments", "2", "--hv.sync-delay", "1"], id="streaming"),
    ],
)
def test_a_shard_that_loses_an_average_heals_its_cluster_within_two_rounds(galaxy, schedule):
    """2-rank clusters: only cluster 0's rank-1 averager (one shard pair) never sends the last average of
    round 2, so cluster 1 has one shard whole and one partial — the start of the cascade where a cluster whose
    shards ended a round apart was left out at every later round. Now cluster 1 commits nothing of either
    shard: both its ranks take round 2 from cluster 0 (their Δs are in it), and every round after that is in
    sync, with equal hashes. At H = 2 cluster 0 is already in round 3 when cluster 1 retries round 2: the
    round in the matchmaking key keeps the two apart (before, the retry met round 3, was left out of it and
    re-synced)."""
    steps = ["--max-steps", "20", "--hv.local-steps", "2", "--hv.averaging-timeout", "30", *schedule]
    metrics = [
        galaxy.start_cluster(0, 2, *steps, env=_losing_last_average(of_round=2, local_rank=1)),
        galaxy.start_cluster(1, 2, *steps),
    ]
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 300) == 0, galaxy.log(f"cluster{rank}")[-3000:]
    rounds = [outer_records(m) for m in metrics]
    shown = _both_clusters_rounds(rounds)
    assert rounds[1][2]["round_outcome"] == "adopted", (
        shown
    )  # the fault did hit: cluster 1's round 2 is not whole
    assert rounds[1][2]["param_hash"] == rounds[0][2]["param_hash"], shown
    # within two rounds, as before: under a full suite's load the streaming variant's round 3 once split too
    # (an exchange broke, "received 50.0% results") and cluster 1 re-synced in it; every round from 4 on is
    # checked
    later = range(4, 11)
    assert all(s in rounds[0] and s in rounds[1] for s in later), shown
    for s in later:
        a, b = rounds[0][s], rounds[1][s]
        assert a["in_sync"] and b["in_sync"] and a["galaxy_peers"] == b["galaxy_peers"] == 2, (s, shown)
        assert a["param_hash"] == b["param_hash"], (s, shown)


def _losing_last_average(of_round: int, local_rank: int | None = None) -> dict[str, str]:
    """The environment of a cluster whose reducers never send the last average of all-reduce ``of_round``
    (``faults/lose_last_average``), in every averager or only in ``local_rank``'s."""
    env = fault_env("lose_last_average", OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_OF=of_round)
    if local_rank is not None:
        env["OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_RANK"] = str(local_rank)
    return env


def _both_clusters_rounds(rounds: list[dict[int, dict]]) -> dict[int, list[dict]]:
    """Every round of both clusters, side by side, for a failed assertion to show (pytest cuts whole records
    short)."""
    return {s: [_round_line(r.get(s, {})) for r in rounds] for s in sorted(set(rounds[0]) | set(rounds[1]))}


def test_galaxy_of_one(galaxy):
    metrics = galaxy.start_cluster(0, 1, "--max-steps", "6", "--hv.local-steps", "2", nproc=1)
    assert galaxy.wait("cluster0", 180) == 0, galaxy.log("cluster0")[-3000:]
    rounds = outer_records(metrics)
    assert sorted(rounds) == [1, 2, 3] and all(r["galaxy_peers"] == 1 for r in rounds.values())


# slow: a late joiner takes the galaxy's state and then averages in sync in test_striped_join.py (one rank a
# cluster), and a 2-rank cluster behind the galaxy takes its state shard by shard in test_restart.py
@pytest.mark.slow
def test_late_joiner_downloads_state_and_joins_in_sync(galaxy):
    # cluster 0 trains alone for two rounds (partial rounds proceed), then cluster 1 joins. Cluster 0 runs
    # longer, so a round the late cluster spends behind (its Δ met cluster 0's next round) is re-synced. The
    # late cluster joins at the galaxy's inner step and ends at its own --max-steps: under the suite's load
    # its start (torchrun, imports, DHT, download) took 34 s, 4 of cluster 0's lone rounds, so it gets 5
    # rounds of room.
    policy = ["--hv.local-steps", "5", "--hv.on-partial-round", "proceed", "--hv.averaging-timeout", "8"]
    policy += ["--sample-log", str(galaxy.workdir / "samples")]
    early = galaxy.start_cluster(0, 2, "--max-steps", "55", *policy)
    galaxy.wait_for_step(early, 12, 240)
    late = galaxy.start_cluster(1, 2, "--max-steps", "45", *policy)
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 400) == 0, galaxy.log(f"cluster{rank}")[-3000:]
    assert "downloaded θ_outer" in galaxy.log("cluster1")
    first_round_of_late = min(outer_records(late))
    assert first_round_of_late > 2  # it skipped the rounds it missed
    early_rounds, late_rounds = outer_records(early), outer_records(late)
    together = [s for s in late_rounds if late_rounds[s]["galaxy_peers"] == 2]
    assert together, "the late joiner never averaged with the early cluster"
    # at most one round may come out partial under load (docs/LOG.md), reported as such on a side, and healed:
    # the late cluster's next round (if it has one) re-syncs. Every other round is in sync with equal hashes
    incidents = [s for s in together if not (late_rounds[s]["in_sync"] or late_rounds[s]["resynced"])]
    shown = {s: (_round_line(early_rounds.get(s, {})), _round_line(late_rounds[s])) for s in late_rounds}
    assert len(incidents) <= 1, shown
    for step in incidents:
        assert not (early_rounds[step]["galaxy_complete"] and late_rounds[step]["galaxy_complete"]), shown
        if step + 1 in late_rounds:
            assert late_rounds[step + 1]["resynced"] or late_rounds[step + 1]["in_sync"], shown
    for step in together:
        if step not in incidents:
            assert early_rounds[step]["param_hash"] == late_rounds[step]["param_hash"], shown
    assert len(together) > len(incidents), shown
    # what the fixed roster's data split costs a late joiner (issue 50): the part of the data it would have
    # trained before it came is dealt to nobody (open-diloco audit-data: pages skipped, never read)
    early_pages, late_pages = audit(galaxy.workdir / "samples", [early, late]).clusters
    joined_at = (first_round_of_late - 1) * 5
    assert late_pages.skipped[: joined_at - 1] == list(range(1, joined_at)), late_pages
    assert set(late_pages.skipped) <= set(late_pages.lost) and not early_pages.skipped, early_pages


def _round_line(record: dict) -> dict:
    """What a failed assertion should show of a round (pytest cuts a whole record short)."""
    keys = (
        "galaxy_peers",
        "galaxy_alive",
        "galaxy_complete",
        "in_sync",
        "resynced",
        "retries",
        "rejected_peers",
        "param_hash",
    )
    return {key: record[key] for key in keys if key in record}


# (SIGKILL is slow: test_membership's killed cluster covers what a crash leaves the survivor)
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGKILL, marks=pytest.mark.slow), signal.SIGINT])
def test_a_lost_cluster_does_not_stop_the_other(galaxy, sig):
    # a lonely round waits the whole averaging timeout for its lost partner: keep both short
    common = [
        "--max-steps",
        "20",
        "--hv.local-steps",
        "5",
        "--hv.on-partial-round",
        "proceed",
        "--hv.averaging-timeout",
        "8",
        "--hv.final-wait",  # a crash is never back: the survivor's end need not wait for it
        "0",
    ]
    # SIGINT to a 2-rank cluster is the subject of one case (every rank must end); what a SIGKILL leaves the
    # survivor is a galaxy matter, and one rank a cluster shows it
    nproc = 2 if sig == signal.SIGINT else 1
    survivor = galaxy.start_cluster(0, 2, *common, nproc=nproc)
    victim = galaxy.start_cluster(1, 2, *common, nproc=nproc)
    galaxy.wait_for_step(victim, 7, 240)
    galaxy.track()
    if sig == signal.SIGKILL:
        kill_tree(galaxy.procs["cluster1"].pid, signal.SIGKILL)
    else:
        galaxy.stop("cluster1", signal.SIGINT)  # Ctrl+C to torchrun: every rank must end within 15 s
        assert "stopping" in galaxy.log("cluster1") or "interrupted" in galaxy.log("cluster1")
    assert galaxy.wait("cluster0", 300) == 0, galaxy.log("cluster0")[-3000:]
    rounds = outer_records(survivor)
    assert sorted(rounds) == list(range(1, 5))
    assert rounds[4]["galaxy_peers"] == 1 and rounds[1]["galaxy_peers"] == 2
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_metrics(survivor))
    # the survivor's final θ_outer has nobody to confirm it: a killed cluster went silent (it may have been
    # cut off and trained on), a stopped one said it stopped
    unconfirmed = "cluster(s) [1] went silent" in galaxy.log("cluster0")
    assert unconfirmed == (sig == signal.SIGKILL), galaxy.log("cluster0")[-3000:]
