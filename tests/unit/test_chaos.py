"""The chaos soak's schedule and judgement on hand-made records (scripts/chaos/): no processes."""

from __future__ import annotations

from scripts.chaos.analysis import (
    RECONNECT_SECONDS,
    cluster_figures,
    fault_figures,
    galaxy_token_rates,
    hashes_by_step,
    repairable_from,
    windows,
)
from scripts.chaos.judge import lighter_taken, minority_taken, normalize, targets
from scripts.chaos.plan import KINDS, Fault, minority_of, schedule, split_sides
from scripts.chaos.report import cluster_table
from scripts.chaos.run import with_overrides


def sync(
    step: int, t: float, in_sync: bool = True, h: str = "a", resynced: bool = False, peers: int = 2
) -> dict:
    return {
        "outer_step": step,
        "time": t,
        "in_sync": in_sync,
        "param_hash": h,
        "resynced": resynced,
        "galaxy_peers": peers,
        "retries": 0,
        "pseudo_grad_finite": True,
        "pseudo_grad_in_bound": True,
    }


def test_schedule_is_seeded_and_spreads_every_kind():
    a = schedule(8, list(KINDS), 3, 2, 100, seed=5)
    assert [f.to_json() for f in a] == [f.to_json() for f in schedule(8, list(KINDS), 3, 2, 100, seed=5)]
    assert a[0].kind == "late_join" and sum(f.kind == "late_join" for f in a) == 1
    assert set(KINDS) <= {f.kind for f in a}
    triggers = [f.trigger for f in a]
    assert triggers == sorted(triggers) and 10 <= triggers[0] and triggers[-1] <= 75
    assert all(f.shard in (0, 1) for f in a if f.kind == "lost_average")
    late = a[0].cluster
    assert all(f.cluster != late for f in a[1:])  # nothing aimed at a cluster that may not run yet


def test_a_partition_lasts_as_long_as_asked():
    long = schedule(3, ["partition", "slow"], 3, 1, 100, seed=5, durations={"partition": 240.0})
    assert {f.kind: f.seconds for f in long} == {"partition": 240.0, "slow": 60.0}


def test_at_most_one_lost_average_per_cluster():
    faults = schedule(5, ["lost_average"], 2, 1, 50, seed=0)
    assert sorted(f.cluster for f in faults if f.kind == "lost_average") == [0, 1]


def test_trainer_flags_after_dashes_replace_defaults():
    assert with_overrides(["--a", "1", "--b", "2"], ["--b=3", "--c", "4"]) == [
        "--a",
        "1",
        "--b=3",
        "--c",
        "4",
    ]


def test_repair_streak_and_resync_share():
    # cluster 1 is partitioned from t=10 to t=20; its first two syncs after are bad, the third good
    c0 = [sync(s, float(s * 2)) for s in range(1, 16)]
    c1 = [sync(s, float(s * 2) + 0.5) for s in range(1, 5)]
    c1 += [sync(s, float(s * 2) + 0.5, in_sync=False, h="b") for s in range(5, 10)]  # apart: t 10.5 .. 18.5
    # a re-sync that took a state the galaxy then left behind, and a partial round: still apart
    c1 += [sync(10, 20.5, in_sync=False, resynced=True, h="c"), sync(11, 22.5, in_sync=False, h="c")]
    c1 += [sync(12, 24.5)]
    c1 += [sync(s, float(s * 2) + 0.5) for s in range(13, 16)]
    c1[1]["resynced"] = True  # one re-sync with no fault to blame, before the partition
    c1[2]["retries"] = 1  # one retried sync with no fault to blame, before it
    c1[6]["retries"] = 2  # and one in the partition: the fault's
    fault = Fault(0, "partition", 1, trigger=5, seconds=10, start=10.0, end=20.0)
    syncs = [c0, c1]
    table = hashes_by_step(syncs)
    (row,) = fault_figures([fault], syncs, table)
    assert row["repair_target"] == [3, 4.5] and row["repair_by_cluster"]["0"] == [2, 4.0]  # 11 split
    assert row["repaired"] and row["repair_syncs"] == 3
    repairs = {(0, 0): 2, (0, 1): 3}
    fig = cluster_figures(1, c1, windows([fault], syncs), repairs, table)
    assert fig["out_of_sync"] == 7 and fig["longest_out_of_sync_run"] == 7
    assert fig["longest_out_of_sync_run_after_faults"] == 2  # 10 and 11, after the fault's end
    assert fig["resynced"] == 2 and fig["resynced_without_fault"] == 1  # sync 10 is the repair's
    assert fig["syncs_without_fault"] == 15 - 5 - 2  # five apart, two of the repair allowance
    assert fig["retried_without_fault"] == 1 and fig["retried_share_without_fault"] == 1 / 8
    assert fig["split_syncs"] == 7 and fig["final_param_hash"] == "a"
    fig["stopped"] = False
    verdict = {t["target"]: t["passed"] for t in targets([fig, fig], [row], hung=False, left_running=[])}
    assert verdict["every repair within 2 syncs"] is False
    assert verdict["out of sync ≤ 2 syncs in a row after any fault"] is True
    assert verdict["≤ 1% of syncs re-synced with no fault to blame"] is False  # 1 of 8
    assert verdict["≤ 5% of each cluster's syncs retried with no fault to blame"] is False  # 1 of 8
    clean = {**fig, "retried_without_fault": 0, "retried_share_without_fault": 0.0}
    verdict = {t["target"]: t["passed"] for t in targets([clean, fig], [row], hung=False, left_running=[])}
    assert verdict["≤ 5% of each cluster's syncs retried with no fault to blame"] is False  # each cluster's
    verdict = {t["target"]: t["passed"] for t in targets([clean, clean], [row], hung=False, left_running=[])}
    assert verdict["≤ 5% of each cluster's syncs retried with no fault to blame"] is True


def test_a_sync_is_good_when_the_galaxy_holds_its_state_whatever_the_cluster_knew():
    # cluster 1 is cut off from t=10 to t=20 and trains alone (steps 5-9) while cluster 0 is stuck in round 5;
    # after the heal cluster 0 takes cluster 1's state at step 9: cluster 1's round 9 ran alone (in_sync
    # false), yet both hold one θ there. Step 8 has no counterpart: only its own in_sync can speak for it.
    c0 = [sync(s, float(s * 2)) for s in range(1, 5)] + [sync(9, 26.0, in_sync=False, resynced=True, h="x")]
    c0 += [sync(10, 30.0, h="y")]
    c1 = [sync(s, float(s * 2) + 0.5) for s in range(1, 5)]
    c1 += [sync(s, 8.0 + s, in_sync=False, h=f"b{s}", peers=1) for s in range(5, 9)]  # alone: t 13 .. 16
    c1 += [sync(8, 20.1, in_sync=False, h="b8", peers=1), sync(9, 21.0, in_sync=False, h="x", peers=1)]
    c1 += [sync(10, 30.0, h="y")]
    fault = Fault(0, "partition", 1, trigger=5, seconds=10, start=10.0, end=20.0)
    syncs = [c0, c1]
    (row,) = fault_figures([fault], syncs, hashes_by_step(syncs))
    assert row["repair_by_cluster"] == {"0": [1, 6.0], "1": [2, 1.0]}
    assert row["repair_syncs"] == 2
    # out of sync is the hash's verdict: cluster 1's round 9 (in_sync false, held by both) is not, its second
    # step 8 (no counterpart, in_sync false) is; the flag's lagging streak is reported beside it
    fig = cluster_figures(1, c1, windows([fault], syncs), {(0, 1): 2}, hashes_by_step(syncs))
    assert fig["longest_out_of_sync_run_after_faults"] == 1 and fig["out_of_sync"] == 5
    assert fig["in_sync_false"] == 6 and fig["longest_in_sync_false_run_after_faults"] == 2


def test_a_lost_average_inside_a_partition_is_repaired_from_the_partitions_end():
    cut = Fault(0, "partition", 1, trigger=5, seconds=10, start=10.0, end=20.0)
    lost = Fault(1, "lost_average", 1, trigger=6, start=12.0, end=12.5)
    late = Fault(2, "late_join", 0, trigger=1, start=0.0, end=30.0)
    assert repairable_from(lost, [cut, lost, late]) == 20.0  # alone until the link is back
    assert repairable_from(lost, [lost, late]) == 12.5  # a joiner not there yet moves nothing
    c0 = [sync(s, float(s * 2)) for s in range(1, 16)]
    c1 = [
        sync(s, float(s * 2) + 0.5, in_sync=s < 5 or s > 10, h="a" if s < 5 or s > 10 else "b")
        for s in range(1, 16)
    ]
    syncs = [c0, c1]
    rows = fault_figures([cut, lost], syncs, hashes_by_step(syncs))
    assert (
        rows[1]["repair_from"] == 20.0
        and rows[1]["repair_by_cluster"]["1"] == rows[0]["repair_by_cluster"]["1"]
    )


def test_a_kill_lasts_until_the_victim_syncs_again():
    fault = Fault(0, "kill_restart", 1, trigger=3, seconds=5, start=10.0, end=15.0)
    syncs = [[sync(s, float(s * 2)) for s in range(1, 20)], [sync(1, 2.0), sync(2, 4.0), sync(12, 31.0)]]
    (w,) = windows([fault], syncs)
    assert (w.start, w.end, w.settled) == (10.0, 15.0, 31.0)
    late = Fault(1, "late_join", 1, trigger=3, start=0.0, end=15.0)
    (w,) = windows([late], syncs)
    assert (w.start, w.end, w.settled) == (0.0, 15.0, 31.0)  # the galaxy waited for it from the start


def test_log_lines_become_kinds():
    a = (
        "2026-11-27 08:59:45,513 WARN galaxy_rank=0 rank=1 "
        "local_rank=1 open_diloco.outer: outer step 5: attempt 1/2"
    )
    b = (
        "2026-11-27 09:10:00,000 WARN galaxy_rank=2 rank=0 "
        "local_rank=0 open_diloco.outer: outer step 81: attempt 2/2"
    )
    assert normalize(a) == normalize(b) == "WARN open_diloco.outer: outer step N: attempt N/N"
    peer = (
        "Nov 27 08:59:45.498 [WARN] [x:174] peer 12D3KooWMa2sv7rxA3d24mrxhsK7N1vm2omUf1MNMqhivq5gQt4E sent 3"
    )
    assert normalize(peer) == "[WARN] [x:N] peer PEER sent N"


def test_a_resync_onto_the_cut_off_clusters_own_state_breaks_the_quorum_rule():
    cut = Fault(0, "partition", 2, 10, 30.0, start=100.0, end=130.0)

    def taken(h: str) -> dict:
        return {**sync(6, 140.0, h=h, resynced=True), "state_source": 2}

    majority = [sync(5, 120.0, h="m5")]
    # cluster 0 re-synced onto cluster 2's own θ at step 6 (nobody else reached it): the minority won
    syncs = [[*majority, taken("c6")], [*majority, sync(6, 139.0, h="m6")], [sync(6, 125.0, h="c6")]]
    assert minority_taken([cut], syncs) == ["#0: cluster 0 took cluster 2's state at outer step 6"]
    # onto the θ cluster 1 reached without it (the majority's, which cluster 2 took first): no breach
    syncs[0][-1] = taken("m6")
    assert minority_taken([cut], syncs) == []
    # two clusters: no majority to keep, the rule does not apply
    assert minority_taken([cut], [[taken("c6")], [sync(6, 125.0, h="c6")]]) == []


def test_a_split_halves_the_galaxy_and_the_side_without_rank_0_is_the_minority():
    assert split_sides(1, 4) == ([1, 2], [0, 3])
    assert split_sides(3, 4) == ([0, 3], [1, 2])  # wraps
    assert minority_of(Fault(0, "split", 1, 10, 60.0), 4) == [1, 2]
    # after cluster 0 left for good (an elastic soak), a split of [3, 0] | [1, 2] leaves 3 alone: the minority
    left = Fault(1, "leave", 0, 5, start=1.0, end=2.0)
    assert minority_of(Fault(2, "split", 3, 20, 60.0, start=10.0), 4, [left]) == [3]
    assert minority_of(Fault(0, "split", 3, 10, 60.0), 4) == [1, 2]  # its side holds rank 0
    assert minority_of(Fault(0, "partition", 0, 10, 30.0), 4) == [0]


def test_a_majority_cluster_taking_a_split_minoritys_own_state_breaks_the_quorum_rule():
    split = Fault(0, "split", 1, 10, 60.0, start=100.0, end=160.0)  # {1, 2} | {0, 3}: {1, 2} hold
    syncs = [[sync(5, 120.0, h="m5")] for _ in range(4)]
    syncs[2].append(sync(6, 150.0, h="f6"))  # the minority's own θ (a fork it should not have made)
    syncs[3].append({**sync(6, 170.0, h="f6", resynced=True), "state_source": 2})
    assert minority_taken([split], syncs) == ["#0: cluster 3 took cluster 2's state at outer step 6"]
    syncs[1].append({**sync(6, 171.0, h="f6", resynced=True), "state_source": 2})  # inside it: its own
    assert len(minority_taken([split], syncs)) == 1
    syncs[0].append(sync(6, 165.0, h="f6"))  # cluster 0 reached it by itself: the majority's
    assert minority_taken([split], syncs) == []


def test_taking_a_chain_with_less_committed_work_than_ones_own_breaks_the_heal_rule():
    def at(step: int, work: int, source: int | None = None) -> dict:
        return {**sync(step, float(step), h=f"h{step}"), "committed_work": work, "state_source": source}

    # cluster 1 committed alone to outer step 9 (work 90); cluster 0 (work 120 at step 6) took its state
    syncs = [[at(5, 100), at(6, 120), at(9, 90, source=1)], [at(9, 90)]]
    assert lighter_taken(syncs) == ["cluster 0 took cluster 1's state at outer step 9: work 90, its own 120"]
    syncs[1].append(at(6, 120, source=0))  # the lighter fork taking the heavier chain: the rule
    syncs[0][-1] = at(7, 130)
    assert lighter_taken(syncs) == []
    assert (
        lighter_taken([[sync(5, 1.0, h="a"), {**sync(6, 2.0, h="b"), "state_source": 1}]]) == []
    )  # no counts


def test_a_cut_lasts_until_the_cut_off_cluster_is_back_in_a_round():
    # cluster 1 is cut off from t=10 to t=20; after it, it takes the state twice (the galaxy committed during
    # the first download) and is back in a round at t=27: the galaxy's retries until then are the cut's
    cut = Fault(0, "partition", 1, trigger=5, seconds=10, start=10.0, end=20.0)
    c0 = [sync(s, float(s * 2)) for s in range(1, 20)]
    c1 = [sync(s, float(s * 2) + 0.5) for s in range(1, 5)]
    c1 += [sync(10, 22.0, resynced=True, peers=0), sync(11, 24.0, resynced=True, peers=0)]
    c1 += [{**sync(13, 27.0), "committed": True}, sync(14, 29.0)]
    (w,) = windows([cut], [c0, c1])
    assert (w.start, w.end, w.settled, w.back) == (10.0, 20.0, 20.0, 27.0)
    c0[12]["retries"] = 1  # round 13 at t=26, while cluster 1 was not back yet: the cut's
    c0[14]["retries"] = 1  # round 15 at t=30, after: no fault to blame
    fig = cluster_figures(0, c0, [w], {(0, 0): 1}, hashes_by_step([c0, c1]))
    assert fig["retried_without_fault"] == 1
    # a cluster not back within BACK_LIMIT syncs: the window ends at its BACK_LIMIT-th, later trouble counts
    stuck = c1[:4] + [sync(s, 20.0 + s, resynced=True, peers=0) for s in range(10, 16)]
    (w,) = windows([cut], [c0, stuck])
    assert w.back == 32.0  # its third sync after the cut (t=30, 31, 32, ...)
    # tries right after the heal in which it saw nobody alive but itself (the others not heard again yet) do
    # not use up its syncs: it takes the state at t=38 and is back in a round at t=41, however many came first
    alone = {"committed": False, "galaxy_alive": 1}
    lone = c1[:4] + [{**sync(9, 20.0 + i / 2, peers=1), **alone} for i in range(1, 6)]
    lone += [sync(10, 38.0, resynced=True, peers=0), {**sync(13, 41.0), "committed": True}]
    (w,) = windows([cut], [c0, lone])
    assert w.back == 41.0
    # ... but only within RECONNECT_SECONDS of the heal: a cluster still alone after that is in trouble
    late = c1[:4] + [{**sync(9, 20.0 + RECONNECT_SECONDS + i, peers=1), **alone} for i in range(1, 6)]
    (w,) = windows([cut], [c0, late])
    assert w.back == 20.0 + RECONNECT_SECONDS + 3  # its third try after the allowance
    # ... and a round of one in which it saw the others alive is a try of its own: it counts
    heard = c1[:4] + [{**sync(9, 20.0 + i / 2, peers=1), **alone, "galaxy_alive": 2} for i in range(1, 6)]
    (w,) = windows([cut], [c0, heard])
    assert w.back == 21.5
    # a split: the side without rank 0 is the one out of the galaxy; its latest return ends the window
    split = Fault(1, "split", 1, trigger=5, seconds=10, start=10.0, end=20.0)
    c2 = [sync(s, float(s * 2)) for s in range(1, 20)]
    c3 = [sync(s, float(s * 2)) for s in range(1, 5)] + [{**sync(14, 35.0), "committed": True}]
    (w,) = windows([split], [c0, c1, c2, c3])  # sides {1, 2} and {0, 3}: {1, 2} is out
    assert w.back == 27.0
    (w,) = windows([Fault(2, "split", 2, trigger=5, seconds=10, start=10.0, end=20.0)], [c0, c1, c2, c3])
    assert w.back == 35.0  # sides {2, 3} and {0, 1}: cluster 3 is back last


def test_an_elastic_soak_has_one_leave_ids_ranked_like_its_clusters_and_judges_its_pages(tmp_path):
    import json

    from open_diloco.cluster_id import rank_of
    from scripts.chaos.judge import GOODPUT_GOAL, by_cluster_number, elastic_rows
    from scripts.chaos.plan import ELASTIC_KINDS
    from scripts.chaos.run import SoakConfig, soak_ids, trainer_flags

    faults = schedule(20, list(ELASTIC_KINDS), 4, 2, 150, seed=5)
    assert sum(f.kind == "leave" for f in faults) == 1 and faults[0].kind == "late_join"
    ids = soak_ids(4)  # a side's lowest rank is its lowest cluster number, as in a fixed galaxy
    assert [rank_of(i) for i in ids] == sorted(rank_of(i) for i in ids) and len(set(ids)) == 4
    cfg = SoakConfig(4, 2, None, 40, 4, 2, 1, [], 0, 60.0, tmp_path, tmp_path, "python")
    cfg.elastic, cfg.genesis = True, 3
    flags = trainer_flags(cfg, 2, "/ip4/127.0.0.1/tcp/1", None)
    assert "--hv.world-rank" not in flags and flags[flags.index("--hv.cluster-id") + 1] == ids[2]
    assert flags[flags.index("--hv.galaxy-size") + 1] == "3" and "--sample-log" in flags
    # a re-sync's source is a galaxy rank: the judge reads it as the soak's cluster number
    for c in (0, 1):
        config = {"config": {"hv": {"world_rank": rank_of(ids[c])}}}
        (tmp_path / f"cluster{c}.jsonl").write_text(json.dumps(config) + "\n")
    mapped = by_cluster_number([[{"state_source": rank_of(ids[1])}], [{"state_source": None}]], tmp_path)
    assert mapped == [[{"state_source": 1}], [{"state_source": None}]]
    pages = dict(cursor=10, once=8, lost=[], twice=[], in_flight=2, unmatched=[])
    good = [{"tokens_computed": 100, "tokens_committed": 95}]
    assert all(row["passed"] for row in elastic_rows(pages, good))
    low = [{"tokens_computed": 100, "tokens_committed": int(100 * GOODPUT_GOAL) - 1}]
    assert [row["passed"] for row in elastic_rows({**pages, "twice": [3]}, low)] == [False, False]
    assert elastic_rows(None, good) == []  # a fixed soak: no such targets


def test_the_report_puts_the_galaxys_tokens_per_second_beside_its_goodput():
    # two clusters over 100 s of syncs: 1,000 + 600 tokens computed, 900 + 300 committed. A cluster that
    # computes less (a holding one that pauses) lowers the first rate; only committing less lowers the second
    def figures(cluster, computed, committed, first, last):
        records = [{**sync(1, first), "tokens_computed": computed // 2}, sync(2, last)]
        records[-1] |= {"tokens_computed": computed, "tokens_committed": committed}
        return cluster_figures(cluster, records, [], {}, hashes_by_step([records]))

    clusters = [figures(0, 1000, 900, 10.0, 110.0), figures(1, 600, 300, 20.0, 90.0)]
    assert galaxy_token_rates(clusters) == (16.0, 12.0)
    assert galaxy_token_rates([{**clusters[0], "tokens_computed": None}]) is None
    rows = "\n".join(cluster_table([{**c, "launches": 1, "stopped": False} for c in clusters]))
    assert "goodput (tokens committed ÷ computed, every cluster): 75.0%" in rows
    assert "tokens per second over the syncs' span: 16 computed, 12 committed" in rows
