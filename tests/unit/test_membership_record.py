"""The typed membership record (open_diloco/membership_record.py): what a cluster publishes is read back
whole, an older version's record reads with safe defaults, and a value that is not ours is refused. The wire
is a contract between versions: ``to_wire`` must give back exactly the keys and values read."""

from __future__ import annotations

import dataclasses

from open_diloco.membership_record import WIRE_FIELDS, MemberRecord

# a record as a cluster of this version publishes it, after a few rounds (galaxy/status.py StatusPublisher)
PUBLISHED = {
    "galaxy_rank": 1,
    "host": "site-b",
    "model_fingerprint": "9f2c",
    "ranks": 2,
    "codec": "none",
    "fragments": 1,
    "round_steps": "equal",
    "model_config": {"num_hidden_layers": 6, "hidden_size": 128},
    "local_steps": 20,
    "version": "open-diloco 0.3.0",
    "peer_id": "QmRank0",
    "shard_peer_ids": ["QmRank0", "QmRank1"],
    "client_mode": False,
    "state": "training",
    "inner_step": 61,
    "outer_step": 3,
    "started_at": 1_700_000_000.5,
    "heartbeat_seconds": 5.0,
    "member_expiry_seconds": 15.0,
    "loss": 4.25,
    "tokens_per_second": 12_345.6,
    "param_hash": "ab12cd",
    "in_sync": True,
    "galaxy_peers": 2,
    "galaxy_alive": 2,
    "allreduce_seconds": 0.42,
    "bytes_sent": 1_048_576,
    "bytes_received": 1_048_576,
    "round_attempt": [4, 0],
    "inner_steps": 20,
    "round_inner_steps": 20,
    "round_weight": 1.0,
    "inner_step_seconds": 0.125,
    "round_ended_at": 1_700_000_100.25,
    "round_wall_seconds": 2.75,
    "published_at": 1_700_000_101.0,
    "seq": 42,
}


def test_a_published_record_reads_back_whole_and_goes_out_exactly_as_it_came():
    record = MemberRecord.from_wire(PUBLISHED)
    assert record is not None and record.extra == {}  # every key published is a named field
    assert record.to_wire() == PUBLISHED
    assert MemberRecord.from_wire(record.to_wire()) == record
    assert record.attempt == (4, 0) and record.step_seconds == 0.125
    assert record.shard_peer(1) == "QmRank1" and record.is_live(expiry=15.0)
    # the reader's stamp is its own: never published
    stamped = dataclasses.replace(record, last_seen_seconds=3.0)
    assert stamped.to_wire() == PUBLISHED and "last_seen_seconds" not in WIRE_FIELDS


def test_an_older_versions_record_reads_with_safe_defaults_and_adds_no_key():
    old = {"galaxy_rank": 0, "state": "training", "peer_id": "QmOld", "outer_step": 2, "published_at": 5.0}
    record = MemberRecord.from_wire(old)
    assert record.shard_peer_ids == [] and record.shard_peer(0) == "QmOld" and record.shard_peer(1) is None
    assert record.inner_step == -1 and record.attempt is None and record.step_seconds is None
    assert record.client_mode is False and record.model_config is None and record.silent_after == 15.0
    assert record.to_wire() == old  # no field it did not publish appears (client_mode, shard_peer_ids, …)


def test_a_value_that_is_not_ours_is_refused():
    for foreign in (None, "status", [1, 2], {}, {"galaxy_rank": "1"}, {"galaxy_rank": True}, {"rank": 0}):
        assert MemberRecord.from_wire(foreign) is None, foreign


def test_keys_this_version_does_not_read_are_kept_for_the_wire():
    newer = {**PUBLISHED, "energy_joules": 1.5e6, "regions": ["eu", "us"]}
    record = MemberRecord.from_wire(newer)
    assert record.extra == {"energy_joules": 1.5e6, "regions": ["eu", "us"]}
    assert record.to_wire() == newer
    # an ill-typed value of a known field reads as the default, and still goes out as it came
    odd = {**PUBLISHED, "outer_step": "3", "round_attempt": [4], "inner_step_seconds": True}
    record = MemberRecord.from_wire(odd)
    assert record.outer_step == -1 and record.step_seconds is None and record.to_wire() == odd
    assert dataclasses.replace(record, outer_step=4).to_wire()["outer_step"] == 4  # set since: it wins
    assert MemberRecord.from_wire({**PUBLISHED, "round_attempt": [4]}).attempt is None


def test_a_record_built_in_code_publishes_what_it_sets():
    record = MemberRecord(galaxy_rank=2, state="finished", outer_step=7)
    assert record.to_wire() == {"galaxy_rank": 2, "state": "finished", "outer_step": 7}
    assert dataclasses.replace(record, client_mode=True).to_wire()["client_mode"] is True
