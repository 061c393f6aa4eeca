"""The WAN lab (scripts/wan/): its self-check, a real galaxy across its namespaces, and its clean-up.

Needs root and iproute2 (CI runs as root); skipped elsewhere, except the test of the no-root message."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from open_diloco.local_galaxy import Galaxy, outer_records
from open_diloco.processes import alive
from scripts.wan import lab as wanlab
from scripts.wan.lab import Lab, lab_namespaces
from tests.conftest import REPO, read_metrics
from tests.support.faults import paced

# one lab at a time: the links' delays and rates are what these tests measure
pytestmark = [pytest.mark.wan, pytest.mark.xdist_group("wan")]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(map(__import__("shutil").which, ("ip", "tc"))),
    reason="the WAN lab needs root and iproute2",
)
HEAL_SECONDS = 12.0
"""The heal's fixed seconds after a partition (a new connection a round trip after the link is back, a
heartbeat, a read at a round's end, a state download): 5-8 s measured, with a margin."""


def lab_pids(lab: Lab) -> list[int]:
    return [proc.pid for proc in [*lab.forwarders.values(), lab.reaper] if proc is not None]


def assert_gone(lab: Lab, pids: list[int]) -> None:
    assert lab.leftovers() == [], lab.leftovers()
    assert alive(pids) == [], f"lab processes left: {alive(pids)}"
    assert not (wanlab.RUNTIME / f"{lab.run_id}.json").exists()


@needs_root
def test_self_check_within_ten_percent():
    with Lab(2, "home") as lab:
        pids = lab_pids(lab)
        figures = lab.check()
    print(wanlab.format_check(figures))
    assert figures["ok"], figures
    assert_gone(lab, pids)


LISTENER = """
import socket, sys
server = socket.create_server((sys.argv[1], 7790))
print("ready", flush=True)
while True:
    server.accept()[0].close()
"""


def _reaches(lab: Lab, src: str, dst: str) -> bool:
    """Whether a TCP connection from ``src``'s namespace to ``dst``'s listener opens within 3 s."""
    connect = f"import socket; socket.create_connection(('{lab.address(dst)}', 7790), timeout=3)"
    return subprocess.run([*lab.exec_prefix(src), sys.executable, "-c", connect], timeout=30).returncode == 0


@needs_root
def test_a_split_cuts_between_its_sides_and_not_within_them():
    # the chaos soak's 2 | 2 split (scripts/chaos/plan.py): nftables on the lab's bridge, each side's
    # links up (unlike a partition, which takes one cluster's link down)
    from scripts.wan import control

    ends = ["c0", "c1", "c2", "dht"]
    with Lab(3, "lan") as lab:
        pids = lab_pids(lab)
        listeners = [
            subprocess.Popen(
                [*lab.exec_prefix(name), sys.executable, "-c", LISTENER, lab.listen_address(name)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for name in ends
        ]
        pids += [proc.pid for proc in listeners]
        try:
            assert all("ready" in proc.stdout.readline() for proc in listeners)
            control.set_split(lab.run_id, (["c0", "dht"], ["c1", "c2"]))
            split = {(a, b) for a in ends for b in ends if a != b and _reaches(lab, a, b)}
            control.set_split(lab.run_id, None)
            healed = {(a, b) for a in ends for b in ends if a != b and _reaches(lab, a, b)}
        finally:
            for proc in listeners:
                proc.kill()
                proc.wait(timeout=5)
    assert_gone(lab, pids)
    assert split == {("c0", "dht"), ("dht", "c0"), ("c1", "c2"), ("c2", "c1")}
    assert healed == {(a, b) for a in ends for b in ends if a != b}


@needs_root
def test_two_clusters_over_intercontinental(tmp_path):
    # 4 rounds, every one ending bitwise equal in both clusters, rounds 1-3 averaged by both. The last round
    # is held to the run's promise only: it once came out partial for one cluster (the other exited right
    # after it, its p2pd ending while TCP still retransmitted its span over the lossy 150 ms path: "received
    # 93.7% results"), and the end of the run (CatchUp.settle_final) is what then puts both on one θ. Since
    # the finished cluster waits there for the galaxy, 3 runs of 2026-12-04 averaged all 4 rounds with both
    steps = ["--max-steps", "20", "--hv.local-steps", "5", "--hv.averaging-timeout", "30"]
    with Lab(2, "intercontinental") as lab:
        pids = lab_pids(lab)
        galaxy = Galaxy(tmp_path, lab=lab)
        try:
            metrics = [galaxy.start_cluster(rank, 2, *steps, nproc=1) for rank in (0, 1)]
            for rank in (0, 1):
                assert galaxy.wait(f"cluster{rank}", 150) == 0, galaxy.log(f"cluster{rank}")[-3000:]
        finally:
            galaxy.close()
        pids += sorted(galaxy.seen_pids)
    assert_gone(lab, pids)
    rounds = [outer_records(m) for m in metrics]
    assert set(rounds[0]) == set(rounds[1]) == {1, 2, 3, 4}, (sorted(rounds[0]), sorted(rounds[1]))
    for step in (1, 2, 3, 4):
        a, b = rounds[0][step], rounds[1][step]
        assert a["param_hash"] == b["param_hash"], (step, a["param_hash"], b["param_hash"])
        if step == 4:
            continue
        assert a["galaxy_peers"] == b["galaxy_peers"] == 2
        # a round crossed the emulated ocean: at least one round trip of 150 ms
        assert a["allreduce_seconds"] > 0.15
    for m in metrics:
        losses = [r["loss"] for r in read_metrics(m)]
        assert losses[-1] < losses[0], losses


PARTITION_RUN = (
    "--max-steps 5000 --hv.local-steps 50 --hv.averaging-timeout {averaging_timeout} "
    "--hv.heartbeat-interval 1 --hv.member-expiry 4 --hv.on-partial-round proceed --hv.fork-after 2"
)


@needs_root
def test_a_partition_of_two_heals_onto_the_heavier_chain_and_records_what_was_dropped(tmp_path):
    # cluster 1's link goes down for 30 s after round 2. Of two clusters, cluster 0 holds the roster's
    # lowest rank: it is the quorum of the split (outer/quorum.py) and trains on alone; cluster 1's rounds
    # hold, and after --hv.fork-after (2 s here) it commits on a fork of its own. Once the link is back the
    # galaxy keeps the chain with more committed work (below): the lighter side takes the other's state and
    # records the rounds it dropped. The two average together again with equal hashes within 2 rounds.
    # H = 50 at a device's pace (0.1 s a step, faults/paced_steps; flat out, the two clusters kept both cores
    # busy for the whole test) makes a round 7-10 s: the heal costs seconds whatever the round length (5-7 s:
    # HEAL_SECONDS), so "2 rounds" needs rounds of several seconds, still far shorter than a real galaxy's.
    averaging_timeout = 10
    steps = PARTITION_RUN.format(averaging_timeout=averaging_timeout).split()
    with Lab(2, "region") as lab:
        pids = lab_pids(lab)
        galaxy = Galaxy(tmp_path, lab=lab)
        try:
            metrics = [galaxy.start_cluster(rank, 2, *steps, nproc=1, env=paced(0.1)) for rank in (0, 1)]
            galaxy.wait_for_step(metrics[1], 100, 240)
            lab.set_link("cluster1", up=False)
            cut_at = [max(outer_records(m)) for m in metrics]
            time.sleep(30)
            apart = [max(outer_records(m)) for m in metrics]
            lab.set_link("cluster1", up=True)
            back, back_wall = time.monotonic(), time.time()
            healed = galaxy.wait_until_together(metrics, after=max(apart), seconds=60)
            healed_after = time.monotonic() - back
        finally:
            galaxy.close()
        pids += sorted(galaxy.seen_pids)
    assert_gone(lab, pids)
    rounds = [outer_records(m) for m in metrics]
    _assert_cluster0_trained_alone(rounds, cut_at, apart)
    forked = _held_then_forked(metrics[1])
    assert healed is not None, [
        (r, rounds[0].get(r), rounds[1].get(r)) for r in range(max(apart), max(apart) + 5)
    ]
    _print_timeline(rounds, cut_at, apart, healed, healed_after, back_wall)
    # one model again within 2 rounds of the link's return: the round in flight at the return (the first outer
    # step after it) or the next one ends with equal hashes on both sides (averaged together, or one side took
    # the other's state). Where rounds are shorter than the heal's few fixed seconds, that takes more rounds
    # but no more seconds: seen at rounds of ~4 s, in flight 10, re-synced at 11, together at 12 (11.6 s); and
    # on an unloaded machine, rounds of 2.6 s, in flight 12, equal hashes at 14, 8.3 s after the return. So:
    # within 2 rounds or within HEAL_SECONDS, and the bound in seconds below in every case
    in_flight = max(min(r for r in rounds[side] if rounds[side][r]["time"] > back_wall) for side in (0, 1))
    repaired = next(
        r
        for r in sorted(set(rounds[0]) & set(rounds[1]))
        if r > max(apart) and rounds[0][r]["param_hash"] == rounds[1][r]["param_hash"]
    )
    pace = _median_round_seconds(rounds, before=apart)
    assert repaired <= in_flight + 1 or healed_after <= HEAL_SECONDS, (repaired, in_flight, healed_after)
    # a bound in seconds as well, against a round that stalls (which the count of rounds above cannot see):
    # the round in flight at the return may wait --hv.averaging-timeout for the side that re-syncs, then one
    # more round of compute, plus a few seconds of heal (a new connection, a heartbeat, a state download), in
    # rounds of this run's pace before the return. Seen: 22.9 s at rounds of 10-15 s (the slowest of 12 runs),
    # and 32.2 s at rounds of 9-11 s in a clean-checkout run whose round in flight waited out its 10 s timeout
    assert healed_after < averaging_timeout + 2 * pace + 5, (healed_after, pace)
    # the heal went one way, onto the chain with more committed work: one side took the other's state and
    # names the rounds it dropped, never the heavier. That is cluster 1 and its fork (cluster 0 committed
    # every round of the cut, cluster 1 all but its held ones; equal work goes to the lowest rank), unless
    # its fork got a round more in: then cluster 0 takes it, by the same rule
    took = [c for c in (0, 1) if any(rounds[c][r].get("resynced") for r in rounds[c] if r > cut_at[c])]
    assert len(took) == 1, took
    dropped = [r["ledger_dropped"] for r in read_metrics(metrics[took[0]]) if r.get("ledger_dropped")]
    assert dropped and dropped[0]["work"] <= dropped[0]["kept_work"], dropped
    first, last = dropped[0]["rounds"]
    if took == [1]:
        assert first <= min(forked) and max(forked) <= last, (dropped, forked)
    else:
        assert dropped[0]["work"] < dropped[0]["kept_work"], dropped  # a tie would keep cluster 0's


def _assert_cluster0_trained_alone(rounds: list[dict], cut_at: list[int], apart: list[int]) -> None:
    """While the link was down, cluster 0 (the split's quorum) applied lone rounds and claimed no sync."""
    # apart, cluster 0 trained on alone and neither hung: it finished rounds after the cut within the 30 s
    # (the round in flight at the cut may wait --hv.averaging-timeout for the other side, and rounds are
    # 7-10 s here, so how many more fit in 30 s is the machine's, not the galaxy's), and no lone
    # round claims the galaxy agrees with it (the other side fell silent, it did not say it ended). The round
    # in flight at the cut may still have been averaged by both sides just before it (its record lands after
    # the cut was read: seen in CI), and then it is in sync, rightly: judged by its group, not by its time
    while_apart = [rounds[0][r] for r in sorted(rounds[0]) if cut_at[0] < r <= apart[0]]
    assert while_apart, (cut_at, apart)
    seen = [(rec["outer_step"], rec["galaxy_peers"], rec["in_sync"]) for rec in while_apart]
    assert not any(in_sync for _, peers, in_sync in seen if peers < 2), seen
    assert all(peers < 2 for _, peers, _ in seen[1:]), seen  # only the round in flight at the cut was whole
    # a lone round, applied. Whether cluster 0 already counted cluster 1 gone (galaxy_alive 1) depends on
    # whether its DHT node still reaches cluster 1's record across the cut; an unreadable record counts as
    # alive (a round waits rather than skips a cluster that is there), and the round then proceeds as a
    # partial one (seen in a clean-clone run: "proceeding with 1 of 2 live clusters", twice)
    assert any(rec["galaxy_peers"] == 1 and rec["round_outcome"] == "applied" for rec in while_apart), seen


def _held_then_forked(metrics) -> list[int]:
    """The rounds a cut-off cluster committed on a fork (entries marked ``fork``), checking it held first."""
    records = read_metrics(metrics)
    held = [r for r in records if r.get("round_outcome") == "held"]
    forked = [r["outer_step"] for r in records if (r.get("ledger") or {}).get("fork")]
    assert held and forked, (len(held), forked)
    return forked


def _median_round_seconds(rounds: list[dict], before: list[int]) -> float:
    """The galaxy's pace: the median seconds between rounds from round 2 to each side's ``before``."""
    return statistics.median(
        rounds[side][r + 1]["time"] - rounds[side][r]["time"]
        for side in (0, 1)
        for r in range(2, before[side])
        if r + 1 in rounds[side]
    )


def _print_timeline(rounds, cut_at, apart, healed, healed_after, back_wall) -> None:
    """What the partition test saw, for its log: each side's rounds around the cut and the heal."""
    print(
        f"rounds at the cut {cut_at}, after 30 s apart {apart}; healed {healed_after:.0f} s after the link "
        f"came back (round {healed})"
    )
    for side in (0, 1):
        print(
            side,
            [
                (r, round(rounds[side][r]["time"] - back_wall, 1), rounds[side][r]["galaxy_peers"])
                for r in sorted(rounds[side])
                if r >= min(apart) - 1 and r <= (healed or 0) + 1
            ],
        )


@needs_root
def test_a_killed_lab_process_is_cleaned_up(tmp_path):
    ready = tmp_path / "lab.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scripts.wan.lab",
            "up",
            "--clusters",
            "1",
            "--profile",
            "lan",
            "--no-check",
            "--ready-file",
            str(ready),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)[0]
        time.sleep(0.1)
    run_id = json.loads(ready.read_text())["run_id"]
    namespaces = [ns for ns in lab_namespaces() if ns.startswith(f"odw-{run_id}-")]
    assert len(namespaces) == 3  # bridge, dht, c0
    inside = [
        int(p)
        for ns in namespaces
        for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    ]
    state = json.loads((wanlab.RUNTIME / f"{run_id}.json").read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30  # the reaper polls every 0.5 s
    while [ns for ns in lab_namespaces() if ns.startswith(f"odw-{run_id}-")] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [ns for ns in lab_namespaces() if ns.startswith(f"odw-{run_id}-")]
    pids = inside + [int(p) for p in state["pids"]]
    deadline = time.monotonic() + 10
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(pids) == []


def test_without_root_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert wanlab.main(["up", "--profile", "lan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lab: error: the WAN lab needs root") and "\n" not in err


def test_profiles_shipped():
    profiles = wanlab.load_profiles()
    ic = profiles["intercontinental"]
    assert (ic.up_mbit, ic.delay_ms, ic.jitter_ms, ic.loss_pct) == (100, 75, 5, 0.1)
    assert (profiles["home"].down_mbit, profiles["home"].up_mbit) == (50, 10)
    assert set(profiles) >= {"lan", "region", "continent", "intercontinental", "home"}
