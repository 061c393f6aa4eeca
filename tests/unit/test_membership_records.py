"""Membership records (galaxy/status.py publishes them, membership_record.py judges them): who a cluster is,
which peer each of its shards averages over, and who counts as gone (pure functions over the records the DHT
returns), and what a peer still looking for a group makes of them."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from open_diloco.errors import RoundFailed
from open_diloco.galaxy.status import cluster_identity
from open_diloco.membership_record import (
    MemberRecord,
    departed,
    lead_of,
    lead_progress,
    never_heard,
    no_reachable_cluster,
    past_round,
    previous_lives,
    schema_conflict,
    silent,
)
from open_diloco.model import load_model_config, model_fingerprint, shape_fields
from open_diloco.outer.protocols import Membership
from tests.conftest import REPO, TINY_MODEL

SCHEMA = {"model_fingerprint": "abc", "ranks": 3, "codec": "none", "fragments": 1}


def read(wire: dict, seen: float = 1.0) -> MemberRecord:
    """``wire`` as a reader gets it: typed, last seen ``seen`` seconds ago."""
    return dataclasses.replace(MemberRecord.from_wire(wire), last_seen_seconds=seen)


def test_a_record_names_every_shards_peer_and_rank_zeros_as_the_clusters():
    record = read(cluster_identity(1, SCHEMA, 20, "open-diloco test", ["QmRank0", "QmRank1", "QmRank2"]))
    assert record.peer_id == "QmRank0"  # status and the allowlist read this key, as before
    assert record.shard_peer_ids == ["QmRank0", "QmRank1", "QmRank2"]
    assert [record.shard_peer(shard) for shard in range(3)] == ["QmRank0", "QmRank1", "QmRank2"]
    assert record.shard_peer(3) is None  # a cluster of another size: no counterpart (and a schema conflict)


def test_a_record_without_shard_peers_names_rank_zero_only():
    old = read({"galaxy_rank": 0, "peer_id": "QmOld"})  # written before shard_peer_ids existed
    assert old.shard_peer(0) == "QmOld"
    assert old.shard_peer(1) is None
    assert MemberRecord(galaxy_rank=0).shard_peer(0) is None


def _schema_of(path_model) -> dict:
    """The schema a trainer publishes for the model at ``path_model`` (built on ``meta``: only names and
    shapes count)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = load_model_config(path_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fields = shape_fields(config.to_dict())
    return {**SCHEMA, "model_fingerprint": model_fingerprint(model), "model_config": fields}


def test_a_model_mismatch_names_the_fields_that_differ():
    here, there = _schema_of(TINY_MODEL), _schema_of(REPO / "configs/models/llama-25m-fresh")
    record = read(cluster_identity(1, there, 20, "test", ["QmRank0"]))
    line = schema_conflict([record], 0, here, expiry=15.0)
    assert "cluster 1 (host " in line and "cannot average with this one: its model differs (" in line, line
    assert "num_hidden_layers 6 here, 8 there" in line and "hidden_size 128 here, 512 there" in line, line
    assert "vocab_size" not in line, line  # what agrees is not named
    assert here["model_fingerprint"] not in line, line


def test_a_model_mismatch_with_a_record_of_no_model_config_names_the_fingerprints():
    here = {**SCHEMA, "model_config": {"num_hidden_layers": 3}}
    # a record of an older version: no model_config
    old = read({"galaxy_rank": 1, **SCHEMA, "model_fingerprint": "def"})
    line = schema_conflict([old], 0, here, expiry=15.0)
    assert "its model_fingerprint is 'def', here 'abc'" in line, line
    # the fields agree, the layouts do not
    same_fields = dataclasses.replace(old, model_config={"num_hidden_layers": 3})
    line = schema_conflict([same_fields], 0, here, expiry=15.0)
    assert "its model_fingerprint is 'def', here 'abc'" in line, line


def test_gone_by_silence_is_told_apart_from_said_it_ended():
    records = [
        MemberRecord(galaxy_rank=0, state="training", last_seen_seconds=1.0, outer_step=7),
        MemberRecord(
            galaxy_rank=1, state="training", last_seen_seconds=30.0, outer_step=9
        ),  # cut off, crashed
        MemberRecord(galaxy_rank=2, state="finished", last_seen_seconds=0.5, outer_step=8),
    ]
    assert departed(records, expiry=15) == {1, 2}
    assert silent(records, expiry=15) == {1: 30.0}  # with how long: a cut is back soon, a crash never
    assert lead_of(records, expiry=15) == (7, 0)  # only a live cluster leads
    assert departed(records, expiry=60) == {2} and silent(records, expiry=60) == {}
    assert lead_of(records, expiry=60) == (9, 0)
    # a finished cluster is gone from the rounds but still serves its final state (its averager drains), so a
    # cluster whose last average never came can take that round from it; a silent or stopped one serves
    # nothing
    assert [record.finished_and_serving(expiry=15) for record in records] == [False, False, True]


def test_the_lead_is_the_chain_with_the_most_committed_work_not_the_furthest_round():
    """A lighter fork (one cluster that committed alone, cheaply) further in rounds does not lead the side
    that kept the galaxy's work; among equal work the furthest round leads (the same chain, a round on)."""
    records = [
        MemberRecord(galaxy_rank=0, state="training", outer_step=20, committed_work=300),
        MemberRecord(galaxy_rank=1, state="training", outer_step=31, committed_work=210),  # the lone fork
        MemberRecord(galaxy_rank=2, state="training", outer_step=21, committed_work=300),
    ]
    assert lead_of(records, expiry=15) == (21, 300)
    old = [MemberRecord(galaxy_rank=0, state="training", outer_step=4)]  # an older version: no work said
    assert lead_of(old, expiry=15) == (4, 0)
    assert not dataclasses.replace(records[2], last_seen_seconds=20.0).finished_and_serving(expiry=15)
    assert not dataclasses.replace(records[2], state="stopped (SIGINT)").finished_and_serving(expiry=15)


def test_a_record_left_by_an_earlier_run_is_no_record_until_that_cluster_writes_again():
    # a galaxy stopped and resumed: cluster 1's record still says its last run finished. Counted as gone, the
    # first cluster back trained its rounds alone; never seen training by this process, it is an earlier run's
    records = [
        MemberRecord(galaxy_rank=0, state="training", last_seen_seconds=1.0, outer_step=2),
        MemberRecord(galaxy_rank=1, state="finished", last_seen_seconds=1.0, outer_step=2),
        MemberRecord(galaxy_rank=2, state="stopped (SIGINT)", last_seen_seconds=1.0, outer_step=2),
    ]
    assert previous_lives(records, seen_training={0}) == {1, 2}
    # a cluster seen training that says it ended is gone, as before (it finished or stopped while we ran)
    assert previous_lives(records, seen_training={0, 1, 2}) == set()


def test_a_cluster_never_heard_from_is_every_other_rank_without_a_record():
    # the averager counts these as gone once NOT_HEARD_SECONDS have passed since its start
    records = [MemberRecord(galaxy_rank=0, state="training"), MemberRecord(galaxy_rank=2, state="finished")]
    assert never_heard(records, galaxy_size=4, galaxy_rank=0) == {1, 3}
    assert never_heard(records, galaxy_size=4, galaxy_rank=1) == {3}
    assert never_heard([], galaxy_size=1, galaxy_rank=0) == set()


def test_a_finished_cluster_leaves_once_its_last_rounds_peers_are_past_it():
    # this cluster's last round with clusters 1 and 2 had id 4 (their records show 5 once they hold its
    # result)
    def record(rank, outer_step, state="training", age=1.0):
        return MemberRecord(galaxy_rank=rank, state=state, last_seen_seconds=age, outer_step=outer_step)

    ranks = frozenset({1, 2})
    assert past_round([record(1, 5), record(2, 6)], 4, ranks, expiry=10.0)
    assert not past_round(
        [record(1, 5), record(2, 4)], 4, ranks, expiry=10.0
    )  # 2 may still be taking its averages
    assert past_round([record(1, 5), record(2, 4, state="stopped (SIGINT)")], 4, ranks, expiry=10.0)
    assert past_round(
        [record(1, 5), record(2, 4, age=30.0)], 4, ranks, expiry=10.0
    )  # silent: nobody to wait for
    assert not past_round(
        [record(1, 5)], 4, ranks, expiry=10.0
    )  # no record read for 2: keep waiting (bounded)
    assert past_round([], 4, frozenset(), expiry=10.0)


def test_the_lead_progress_is_the_furthest_live_cluster_at_the_lead_round_other_than_this_one():
    records = [
        MemberRecord(
            galaxy_rank=rank, state="training", last_seen_seconds=seen, outer_step=outer, inner_step=inner
        )
        for rank, seen, outer, inner in (
            (0, 0.2, 5, 430),
            (1, 0.7, 5, 418),
            (2, 0.1, 4, 470),
            (3, 30.0, 5, 479),
        )
    ]  # rank 3 is silent
    assert lead_progress(records, expiry=15, galaxy_rank=2, lead=5) == (
        430,
        0.2,
    )  # rank 2 is behind: not the lead
    assert lead_progress(records, expiry=15, galaxy_rank=0, lead=5) == (418, 0.7)  # never our own record
    assert lead_progress(records[2:3], expiry=15, galaxy_rank=2, lead=4) == (-1, 0.0)  # nobody else known


class _StillLooking:
    """A hivemind step that never finds a group (``StepControl``'s face: stage, result, cancel)."""

    def __init__(self):
        from hivemind.averaging.control import AveragingStage

        self.stage, self.cancelled = AveragingStage.LOOKING_FOR_GROUP, False

    def result(self, timeout):
        time.sleep(timeout)
        raise TimeoutError

    def cancel(self):
        self.cancelled = True


def _looking_round(monkeypatch, view):
    from open_diloco.galaxy import round_wait
    from open_diloco.galaxy.averager import HivemindAverager

    monkeypatch.setattr(round_wait, "MEMBERSHIP_POLL_SECONDS", 0.01)
    owner = HivemindAverager.__new__(HivemindAverager)
    owner.galaxy_rank, owner.galaxy_size, owner.averaging_timeout, owner.elastic = 0, 2, 5.0, False
    owner.membership = lambda: view
    control = _StillLooking()
    pending = round_wait.HivemindRound(owner, control, {"round_id": 3, "galaxy_rank": 0}, time.monotonic())
    return pending, control


def test_a_peer_looking_for_a_group_in_a_round_the_galaxy_applied_stops_looking(monkeypatch):
    # the other cluster's record is at outer step 4: it applied round 3 (round_id 3 = rounds applied before
    # it)
    pending, control = _looking_round(monkeypatch, Membership(lead=4))
    started = time.monotonic()
    report = pending.wait()
    assert report.overtaken and report.group_size == 1 and control.cancelled
    assert time.monotonic() - started < 1.0  # not the 5 s averaging timeout


def test_a_peer_looking_for_a_group_the_galaxy_has_not_reached_waits_it_out(monkeypatch):
    pending, control = _looking_round(
        monkeypatch, Membership(lead=3)
    )  # the others applied round 2: we are level
    pending.owner.averaging_timeout = 0.2
    with pytest.raises(RoundFailed, match="did not finish"):
        pending.wait()
    assert control.cancelled


class _EndedCancelled(_StillLooking):
    """A hivemind step whose future ended with ``asyncio.CancelledError`` (seen by a refused stranger in the
    suite)."""

    def result(self, timeout):
        raise asyncio.CancelledError


def test_a_step_hivemind_ended_cancelled_is_a_failed_round_not_a_crash(monkeypatch):
    # asyncio.CancelledError is a BaseException: an `except Exception` let it out of the round as a traceback
    pending, _ = _looking_round(monkeypatch, Membership(lead=3))
    pending.control = _EndedCancelled()
    with pytest.raises(RoundFailed, match="round 3 failed: CancelledError"):
        pending.wait()


def test_clusters_that_disagree_on_the_round_steps_refuse_in_one_line():
    here = {**SCHEMA, "round_steps": "by-speed, 1024 tokens per inner step"}
    for there in ("equal", "by-speed, 2048 tokens per inner step"):
        other = read({"galaxy_rank": 1, **SCHEMA, "round_steps": there})
        line = schema_conflict([other], 0, here, expiry=15.0)
        assert f"its round_steps is '{there}', here 'by-speed, 1024 tokens per inner step'" in line, line
        assert "--hv.round-steps" in line and "\n" not in line
    older = read({"galaxy_rank": 1, **SCHEMA})  # a version before round steps: no key
    assert schema_conflict([older], 0, {**SCHEMA, "round_steps": "equal"}, expiry=15.0) is None


def test_a_galaxy_needs_one_cluster_that_is_not_in_client_mode():
    client = read({"galaxy_rank": 0, "client_mode": True})
    other_client = dataclasses.replace(client, galaxy_rank=1)
    reachable = read({"galaxy_rank": 1, "client_mode": False})
    old = read({"galaxy_rank": 1})  # a record of a version before client mode: reachable
    assert no_reachable_cluster([client, other_client], 2, expiry=15.0)
    stopped_on_it = dataclasses.replace(other_client, state="failed")
    assert no_reachable_cluster([client, stopped_on_it], 2, expiry=15.0)
    assert not no_reachable_cluster([client, reachable], 2, expiry=15.0)
    assert not no_reachable_cluster([client, old], 2, expiry=15.0)
    assert not no_reachable_cluster([client], 2, expiry=15.0)  # cluster 1 not in yet: it may be reachable
    # an old run's record of cluster 1 does not count
    assert not no_reachable_cluster(
        [client, read({"galaxy_rank": 1, "client_mode": True}, seen=60.0)], 2, 15.0
    )


def test_a_fixed_and_an_elastic_cluster_refuse_each_other_in_one_line():
    # a fixed cluster counts ranks 0 … N − 1: an elastic one beside it would average unseen by its live count
    elastic = read(cluster_identity(849359237, {**SCHEMA, "membership": "elastic"}, 20, "test", ["QmE"]))
    line = schema_conflict([elastic], 0, {**SCHEMA, "membership": "fixed"}, expiry=15.0)
    assert "its membership is 'elastic', here 'fixed'" in line and "--hv.world-rank or none" in line, line
    older = read({"galaxy_rank": 1, **SCHEMA})  # a version before elastic galaxies: fixed, no key
    assert schema_conflict([older], 0, {**SCHEMA, "membership": "fixed"}, expiry=15.0) is None
