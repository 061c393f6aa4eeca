"""Live membership on real clusters: a galaxy that loses a cluster keeps its pace."""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from open_diloco.local_galaxy import TRACK_SECONDS, outer_records, repaired
from open_diloco.model import build_model, model_fingerprint
from tests.conftest import REPO, SHALLOW_MODEL, kill_tree, read_metrics, trainer_env
from tests.support.faults import paced

pytestmark = pytest.mark.e2e

MATCHMAKING, EXPIRY = 1.0, 4.0
QUICK_MEMBERSHIP = ("--hv.matchmaking-time", str(MATCHMAKING), "--hv.heartbeat-interval", "1")
QUICK_MEMBERSHIP += ("--hv.member-expiry", str(EXPIRY))
"""A cluster counts as gone after 4 s of silence, not 15: the tests' rounds are seconds long."""
DHT_LOOKUP = 0.25
"""hivemind's matchmaking here is bimodal, ~0.03 s or, when two peers declare at once, one more DHT look-up:
~0.2 s, seen with three clusters as with two (CI failed on 0.22 s against twice a measured 0.097 s)."""


def test_a_killed_and_a_finished_cluster_stop_costing_the_others_time(galaxy):
    # Before live membership, every round after a loss waited the whole averaging timeout (here 30 s), three
    # times under `retry`. Cluster 2 is killed outright after round 2, and with it the bootstrap hivemind-dht
    # (the clusters' own DHT nodes carry on); cluster 1 finishes at step 27, cluster 0 trains on to step 45.
    common = [
        "--hv.local-steps",
        "3",
        "--hv.averaging-timeout",
        "30",
        *QUICK_MEMBERSHIP,
        "--hv.final-wait",  # a crash is never back: the survivors' end need not wait for it (the next test)
        "0",
    ]
    metrics = [
        galaxy.start_cluster(rank, 3, "--max-steps", steps, *common, nproc=1)
        for rank, steps in ((0, "45"), (1, "27"), (2, "400"))
    ]
    galaxy.wait_for_step(metrics[2], 6, 240)
    galaxy.track()
    kill_tree(galaxy.procs["cluster2"].pid)
    killed_at_round = max(outer_records(metrics[2]))
    kill_tree(galaxy.procs["dht"].pid)
    for rank in (0, 1):
        assert galaxy.wait(f"cluster{rank}", 240) == 0, galaxy.log(f"cluster{rank}")[-3000:]

    rounds = [outer_records(m) for m in metrics[:2]]
    # one round may come out partial on one side only (docs/LOG.md: seen here under load right after the
    # kill); the side left out then re-syncs and may skip that round's number. At most one such incident,
    # reported as incomplete, healed by a re-sync within two rounds; every other round is checked in full
    # below
    incident = [
        r
        for r in range(killed_at_round + 2, 10)
        if r not in rounds[0]
        or r not in rounds[1]
        or not (rounds[0][r]["galaxy_complete"] and rounds[1][r]["galaxy_complete"])
        or repaired(rounds[0][r])
        or repaired(rounds[1][r])
    ]
    if incident:
        shown = [(r, rounds[0].get(r), rounds[1].get(r)) for r in range(incident[0], incident[-1] + 1)]
        assert incident[-1] - incident[0] <= 1, shown
        assert any(repaired(rounds[side].get(r, {})) for side in (0, 1) for r in incident), shown
    assert set(rounds[0]) | set(incident) == set(range(1, 16)) and max(rounds[0]) == 15
    assert set(rounds[1]) | set(incident) == set(range(1, 10)) and max(rounds[1]) == 9
    before = [rounds[0][r]["allreduce_seconds"] for r in range(1, killed_at_round + 1)]
    # from the second round after the kill on: both survivors average, each round (its retries included) costs
    # at most the old pace + matchmaking + expiry; once the expiry has passed, whole rounds of the two live
    # ones
    for r in (r for r in range(killed_at_round + 2, 10) if r not in incident):
        a, b = rounds[0][r], rounds[1][r]
        assert a["param_hash"] == b["param_hash"] and a["galaxy_peers"] == 2, (r, a, b)
        cost = (a["retries"] + 1) * a["allreduce_seconds"]
        assert cost <= max(before) + MATCHMAKING + EXPIRY, (r, a, before)
    whole = [
        r for r in range(killed_at_round + 2, 10) if r not in incident and rounds[0][r]["galaxy_alive"] == 2
    ]
    assert len(whole) >= 3, [rounds[0][r] for r in range(killed_at_round + 1, 10)]
    for r in whole[1:]:  # (the first may have retried before the expiry passed, then seen 2 alive)
        assert rounds[0][r]["retries"] == 0 and rounds[0][r]["in_sync"] and rounds[1][r]["in_sync"], rounds[
            0
        ][r]
    # with a cluster gone the group is full at the live ones (outer/matchmaking.py): a round waits as long
    # as the galaxy's whole rounds took to form, not --hv.matchmaking-time for a cluster that will not come
    # (issue 48: ≤ 2x the measured matchmaking time)
    all_there = range(2, killed_at_round + 1)  # (round 1 also waits for the slowest start)
    # (measured is at least hivemind's slow mode, DHT_LOOKUP: a round that waited for the gone cluster still
    # fails, it costs the whole 1 s window)
    measured = statistics.median(rounds[side][r]["matchmaking_seconds"] for side in (0, 1) for r in all_there)
    gone = statistics.median(rounds[side][r]["matchmaking_seconds"] for side in (0, 1) for r in whole[1:])
    bar = 2 * max(measured, DHT_LOOKUP)
    assert gone <= bar < MATCHMAKING, (gone, measured, [rounds[0][r] for r in whole])
    # once cluster 1 finished (it said so as it left), cluster 0's rounds wait for nobody
    for r in range(11, 16):
        assert (rounds[0][r]["galaxy_peers"], rounds[0][r]["galaxy_alive"]) == (1, 1), rounds[0][r]
        assert rounds[0][r]["allreduce_seconds"] < 1.0, rounds[0][r]
    log = galaxy.log("cluster0")
    assert "2 of 3 clusters alive (were 3)" in log and "1 of 3 clusters alive (were 2)" in log
    losses = [r["loss"] for r in read_metrics(metrics[0])]
    assert losses[-1] < 0.8 * losses[0]


def test_a_cluster_cut_off_across_the_runs_end_ends_on_the_galaxys_final_state(galaxy):
    """The chaos soak's `lan` seed 3 (docs/results/chaos-soak.md): a cut covered the run's end, the others
    finished and left, and the cut-off cluster came back to nobody serving and ended on a θ of its own. Here
    cluster 2 is paused (silent, as behind a cut) from round 6 until both others have finished round 10, the
    last: with the default --hv.final-wait they wait for a cluster silent that recently, serving; back, it
    sees the galaxy finished, takes its final state and ends there. Three clusters, one final θ_outer."""
    common = [
        "--max-steps",
        "30",
        "--hv.local-steps",
        "3",
        "--hv.averaging-timeout",
        "10",
        *QUICK_MEMBERSHIP,
    ]
    metrics = [galaxy.start_cluster(rank, 3, *common, nproc=1) for rank in range(3)]
    galaxy.wait_for_step(metrics[2], 17, 240)
    galaxy.track()
    with galaxy.paused("cluster2"):
        cut_at = max(outer_records(metrics[2]))
        for rank in (0, 1):
            galaxy.wait_for_step(metrics[rank], 30, 240)
        time.sleep(2 * EXPIRY)  # they are waiting at the end, the cut-off cluster silent
        assert all(galaxy.procs[f"cluster{rank}"].poll() is None for rank in (0, 1))
    back = time.monotonic()
    for rank in range(3):
        assert galaxy.wait(f"cluster{rank}", 240) == 0, galaxy.log(f"cluster{rank}")[-3000:]
    assert time.monotonic() - back < 90, "the finished clusters waited out --hv.final-wait"
    rounds = [outer_records(m) for m in metrics]
    final = [side[max(side)] for side in rounds]
    assert [r["outer_step"] for r in final] == [10, 10, 10], final
    assert len({r["param_hash"] for r in final}) == 1, final
    assert cut_at < 10 and final[2]["round_outcome"] == "resynced", final[2]
    # at once: not a --hv.join-timeout for each round the finished clusters will never serve, each ending in
    # this cluster's Δ alone (before: four such rounds, dropped at its last)
    assert re.search(r"took cluster [01]'s state at outer step 10", galaxy.log("cluster2"))
    assert "pseudo-gradient alone" not in galaxy.log("cluster2")
    for rank in range(3):
        assert "unlike that of" not in galaxy.log(f"cluster{rank}")


def _identities(*directories) -> list[str]:
    """Clusters' key files and allowlist lines, made with `open-diloco identity` (one command per cluster, as
    its operator runs it; side by side)."""
    commands = [
        subprocess.Popen(
            [sys.executable, "-m", "open_diloco", "identity", str(directory)],
            cwd=REPO,
            env=trainer_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for directory in directories
    ]
    lines = []
    for command in commands:
        out, err = command.communicate(timeout=60)
        assert command.returncode == 0 and out.startswith("Qm"), err
        lines.append(out)
    return lines


def _a_stranger_is_refused_and_costs_nothing(galaxy, metrics, tmp_path) -> None:
    """A stranger who knows the run id and the DHT starts beside the galaxy's two members (``metrics``:
    theirs): it is refused both ways (no state, no group) and named once, and the galaxy's rounds go on as
    before."""
    # the stranger: a real averager for the members' shard (same size and model fingerprint, so matchmaking
    # and the schema check would let it in)
    model = build_model(SHALLOW_MODEL, seed=0)
    stranger_log = tmp_path / "stranger.log"
    stranger = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.stranger",
            "--initial-peers",
            galaxy.maddr,
            "--run-id",
            "open_diloco",
            "--numel",
            str(sum(p.numel() for p in model.parameters())),
            "--model-fingerprint",
            model_fingerprint(model),
            "--rounds",
            "3",
        ],
        cwd=REPO,
        env=trainer_env(),
        stdout=stranger_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    galaxy.procs["stranger"] = stranger
    stranger_at = max(outer_records(metrics[0]))
    deadline = time.monotonic() + 120
    while stranger.poll() is None and time.monotonic() < deadline:
        galaxy.track(every=TRACK_SECONDS)
        time.sleep(0.2)
    assert stranger.returncode == 0, stranger_log.read_text()[-3000:]
    stranger_left = max(outer_records(metrics[0]))
    said = [json.loads(line) for line in stranger_log.read_text().splitlines() if line.startswith("{")]
    assert said[0]["download"] is False, said  # refused: no state
    tried = [line for line in said if "round" in line]
    assert len(tried) == 3 and all(line["group_size"] <= 1 for line in tried), said  # no group
    answers = said[-1]["asked_to_lead"]  # its join requests, sent to each member's averager, were refused
    assert len(answers) == 2 and set(answers.values()) == {"PROTOCOL_VIOLATION"}, answers
    for rank in (0, 1):
        refused = [
            line for line in galaxy.log(f"cluster{rank}").splitlines() if "not on --hv.allowlist" in line
        ]
        assert len(refused) == 1 and said[0]["peer_id"] in refused[0], refused  # named once
    rounds = [outer_records(m) for m in metrics]
    during = sorted(r for r in set(rounds[0]) & set(rounds[1]) if stranger_at < r <= stranger_left)
    before = max(rounds[0][r]["allreduce_seconds"] for r in rounds[0] if r <= stranger_at)
    assert len(during) >= 3, during
    # The galaxy's rounds go on as before: both members, equal hashes, the same pace. One round may come out
    # partial on one side (the one-sided race of docs/LOG.md, seen in full suite runs here), which that side
    # retries (`retries`) or, once the other side's record shows the round applied, ends by adopting its state
    # (`resynced`, peers 0; seen once, 2026-11-26). Either is reported, and neither is the stranger's doing:
    # it costs a round its peers or its pace, never splits the galaxy.
    retried = [r for r in during if any(side[r]["retries"] or repaired(side[r]) for side in rounds)]
    assert len(retried) <= 1, [(r, rounds[0][r], rounds[1][r]) for r in retried]
    for r in during:
        a, b = rounds[0][r], rounds[1][r]
        assert a["param_hash"] == b["param_hash"], (r, a, b)
        assert r in retried or (
            a["galaxy_peers"] == b["galaxy_peers"] == 2 and a["allreduce_seconds"] <= before + 3.0
        ), (r, a, b, before)


def test_a_cluster_stopped_with_ctrl_c_costs_nothing_and_resumes_into_the_galaxy(galaxy, tmp_path):
    # The galaxy runs with identity files and an allowlist naming its two clusters. A stranger who knows the
    # run id and the DHT starts beside them: it is refused both ways (no state, no group) and named once, and
    # the galaxy's rounds go on as before. Then cluster 1 is stopped with Ctrl+C, which costs cluster 0
    # nothing, and started again from its checkpoint with the same identity directory: it is let back in.
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text("# the galaxy\n" + "".join(_identities(tmp_path / "id0", tmp_path / "id1")))
    # a run long enough that cluster 0 is still training when cluster 1 is back: alone it trained ~15 steps
    # a second (now at most 10: paced), and a loaded CI machine took 60 s from the stop to the resumed
    # cluster's first step (cluster 0 had finished its 400 steps, and cluster 1 came back to a galaxy that was
    # over); the test ends both
    common = [
        "--max-steps",
        "5000",
        "--hv.local-steps",
        "5",
        "--hv.heartbeat-interval",
        "1",
        "--hv.member-expiry",
        str(EXPIRY),
        "--hv.averaging-timeout",
        "30",
    ]
    members = [*common, "--ckpt.interval", "5", "--hv.allowlist", str(allowlist)]

    def member(rank: int, *extra: str, name: str | None = None):
        return galaxy.start_cluster(
            rank,
            2,
            *members,
            "--ckpt.path",
            str(tmp_path / f"ckpt{rank}"),
            "--hv.identity-path",
            str(tmp_path / f"id{rank}"),
            *extra,
            nproc=1,
            name=name,
            env=paced(0.1),  # a device's pace: flat out, cluster 0 starved cluster 1's restart
        )

    metrics = [member(rank) for rank in (0, 1)]
    galaxy.wait_for_step(metrics[1], 12, 240)
    _a_stranger_is_refused_and_costs_nothing(galaxy, metrics, tmp_path)

    galaxy.procs["cluster1"].send_signal(signal.SIGINT)  # Ctrl+C: torchrun forwards it to the rank
    assert galaxy.wait("cluster1", 60) != 0
    galaxy.track()
    stopped_at = max(outer_records(metrics[1]))
    galaxy.wait_for_step(metrics[0], 5 * (stopped_at + 4), 120)
    alone = outer_records(metrics[0])
    before = max(alone[r]["allreduce_seconds"] for r in alone if r <= stopped_at)  # (a re-sync skips numbers)
    # The round it was stopped in may still have averaged with it before it wrote its metrics, or, when the
    # stop landed in matchmaking, come out partial and been retried once, by then with 1 alive; from the next
    # one on, no retry. Neither waits for the stopped cluster.
    first = min(r for r in alone if r > stopped_at and alone[r]["galaxy_peers"] == 1)
    assert first <= stopped_at + 2, [alone[r] for r in range(stopped_at, first + 1)]
    for r in (first, first + 1):
        assert alone[r]["galaxy_alive"] == 1 and alone[r]["retries"] <= (1 if r == first else 0), alone[r]
        assert (alone[r]["retries"] + 1) * alone[r]["allreduce_seconds"] <= before + 5.0, (alone[r], before)

    # it comes back from its last checkpoint, behind the galaxy: it adopts the galaxy's state and averages
    # again
    del galaxy.procs["cluster1"]
    resumed = member(1, "--ckpt.resume", "latest", name="cluster1")
    together = galaxy.wait_until_together([metrics[0], resumed], after=stopped_at, seconds=180)
    assert galaxy.procs["cluster0"].poll() is None, (
        "cluster 0 ended before cluster 1 was back: raise --max-steps"
    )
    assert together is not None, galaxy.log("cluster1")[-3000:]
    back_rounds = sorted(r for r in outer_records(resumed) if r > stopped_at)
    assert together <= back_rounds[0] + 2, (together, back_rounds)  # within 2 rounds of its return
    assert "resumed from" in galaxy.log("cluster1")
