"""How `open-diloco status` judges the clusters' records: behind, silent, stopped, split."""

from __future__ import annotations

import dataclasses

from open_diloco.membership_record import MemberRecord
from open_diloco.status_view import JSON_KEYS, as_json_rows, build_table, galaxy_line, judge


def record(
    rank: int, outer: int, phash: str, *, seen: float = 1.0, state: str = "training", **extra
) -> MemberRecord:
    return MemberRecord(
        galaxy_rank=rank,
        outer_step=outer,
        inner_step=outer * 10,
        param_hash=phash,
        state=state,
        last_seen_seconds=seen,
        heartbeat_seconds=5.0,
        **extra,
    )


def flags(rows: list[dict]) -> dict[int, list[str]]:
    return {row["galaxy_rank"]: row["flags"] for row in rows}


def test_a_healthy_galaxy_has_no_flags():
    rows = judge([record(0, 4, "aa"), record(1, 4, "aa"), record(2, 4, "aa")])
    assert flags(rows) == {0: [], 1: [], 2: []}
    assert [row["behind_by"] for row in rows] == [0, 0, 0]


def test_behind_counts_rounds_against_the_most_advanced_training_cluster():
    rows = judge([record(0, 7, "aa"), record(1, 5, "bb"), record(2, 9, "cc", state="finished")])
    # the finished cluster does not set the pace; the hash is compared only at the same outer step
    assert flags(rows) == {0: [], 1: ["behind 2 round(s)"], 2: ["finished"]}


def test_silent_after_the_clusters_own_member_expiry():
    assert record(0, 1, "aa").silent_after == 15.0  # no expiry in the record: 3 heartbeats
    assert record(0, 1, "aa", member_expiry_seconds=40.0).silent_after == 40.0
    rows = judge(
        [
            record(0, 3, "aa", seen=2.0),
            record(1, 3, "aa", seen=16.0),
            record(2, 3, "aa", seen=16.0, member_expiry_seconds=40.0),
        ]
    )
    assert flags(rows) == {0: [], 1: ["silent 16s"], 2: []}


def test_a_silent_cluster_does_not_set_the_pace():
    rows = judge([record(0, 3, "aa"), record(1, 6, "bb", seen=100.0)])
    assert flags(rows) == {0: [], 1: ["silent 100s"]}


def test_a_hash_that_differs_from_the_majority_at_its_outer_step_is_flagged():
    rows = judge([record(0, 4, "aa"), record(1, 4, "aa"), record(2, 4, "zz")])
    assert flags(rows) == {0: [], 1: [], 2: ["hash differs"]}
    # two clusters that disagree: no majority, the board cannot tell which split off, so both are flagged
    assert flags(judge([record(0, 4, "aa"), record(1, 4, "zz")])) == {
        0: ["hash differs"],
        1: ["hash differs"],
    }


def test_json_rows_keep_the_contract_keys_and_the_table_renders_every_cluster():
    rows = judge([record(0, 4, "aa", host="site-a"), record(1, 3, "bb", state="stopped (SIGTERM)")])
    out = as_json_rows(rows)
    assert [list(row) for row in out] == [list(JSON_KEYS)] * 2
    assert out[1]["flags"] == ["stopped (SIGTERM)"] and out[1]["behind_by"] == 1
    assert out[0]["host"] == "site-a" and out[0]["last_seen_seconds"] == 1.0 and out[0]["loss"] is None

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(build_table(rows, "demo", expected_size=3))
    text = console.export_text()
    assert "galaxy demo: 2 cluster(s) of 3" in text and "site-a" in text and "stopped (SIGTERM)" in text
    assert "weight" not in text  # equal steps: no pace columns


def test_the_table_shows_each_clusters_steps_per_round_and_weight_when_steps_go_by_speed():
    pace = dict(local_steps=8, round_steps="by-speed, 256 tokens per inner step")
    rows = judge(
        [
            record(0, 4, "aa", round_inner_steps=8, round_weight=1.0, **pace),
            record(1, 4, "aa", round_inner_steps=3, round_weight=0.375, **pace),
        ]
    )
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(build_table(rows, "demo"))
    text = console.export_text()
    assert "steps/round" in text and "weight" in text
    assert "8/8" in text and "3/8" in text and "0.38" in text
    assert as_json_rows(rows)[1]["round_weight"] == 0.375


def test_goodput_per_cluster_and_for_the_galaxy_beside_its_throughput():
    records = [
        record(0, 4, "aa", tokens_computed=1000, tokens_committed=900, tokens_per_second=50.0),
        record(1, 4, "aa", tokens_computed=3000, tokens_committed=1500, tokens_per_second=150.0),
        record(2, 2, "bb", state="finished", tokens_computed=1000, tokens_committed=1000),
        record(3, 4, "aa"),  # an older version: says nothing, counts for nothing
    ]
    rows = judge(records)
    assert [row["goodput"] for row in rows] == [0.9, 0.5, 1.0, None]
    assert as_json_rows(rows)[1]["tokens_committed"] == 1500
    # the finished cluster's work counts, its throughput no more
    assert galaxy_line(records) == (
        "galaxy: goodput 68.0% (tokens committed / computed), 200 tokens/s training"
    )
    # the roster of the heaviest chain (most committed work): a cluster one member called gone is out of it
    records[0] = dataclasses.replace(records[0], roster=[0, 1, 2, 3], committed_work=40)
    records[1] = dataclasses.replace(records[1], roster=[0, 3], committed_work=44)
    assert galaxy_line(records).endswith("; roster [0, 3] (cluster 1's chain, the heaviest)")
    assert as_json_rows(judge(records))[1]["roster"] == [0, 3]
    from rich.console import Console

    console = Console(width=220, record=True)
    console.print(build_table(rows, "demo"))
    text = console.export_text()
    assert "90.0%" in text and "goodput" in text


def test_an_elastic_clusters_id_is_in_its_row_and_beside_its_rank():
    records = [record(849359237, 3, "aa", cluster_id="dae509e326e4"), record(1, 3, "aa")]
    rows = judge(records)
    assert [row["cluster_id"] for row in as_json_rows(rows)] == ["dae509e326e4", None]
    from rich.console import Console

    console = Console(width=220, record=True)
    console.print(build_table(rows, "demo"))
    assert "849359237 (dae509e326e4)" in console.export_text()


def test_an_elastic_galaxy_shows_its_joiners_and_its_data_as_the_heaviest_chains_deal_has_it():
    deal = dict(data_cursor=200, data_committed_pages=150, data_epoch=0.5)
    records = [
        record(7, 5, "aa", cluster_id="a", roster=[7, 9], committed_work=10, **deal),
        record(9, 5, "aa", cluster_id="b", roster=[7, 9], committed_work=10, **deal),
        record(4, 0, None, cluster_id="c"),  # not in the roster yet: joining
    ]
    line = galaxy_line(records)
    assert line.endswith(
        "; roster [7, 9] (cluster 7's chain, the heaviest); joining [4]; data: 200 pages dealt, "
        "150 committed (75.0%), epoch 0.50"
    ), line
    assert as_json_rows(judge(records))[0]["data_cursor"] == 200
