"""Membership ages on the reader's own clock (galaxy/record_ages.py ``RecordAges``): whether a cluster counts
as alive must not depend on two sites' clocks agreeing (issue 34, point 8)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from open_diloco.galaxy import record_ages, status
from open_diloco.galaxy.record_ages import RecordAges
from open_diloco.galaxy.status import StatusPublisher, read_records
from open_diloco.membership_record import MemberRecord, departed

EXPIRY = 15.0
WALL = 1_000_000.0  # the reader's wall clock (get_dht_time) when its monotonic clock reads 0


class Reader:
    """A reader with a clock of its own: monotonic ``now``, wall clock ``WALL + now``."""

    def __init__(self, expiry: float | None = EXPIRY):
        self.now = 0.0
        self.ages = RecordAges(expiry, clock=lambda: self.now)

    def read(self, *records: dict) -> dict[int, MemberRecord]:
        typed = [MemberRecord.from_wire(record) for record in records]
        stamped = self.ages.stamp(typed, wall_now=WALL + self.now)
        return {record.galaxy_rank: record for record in stamped}


class Publisher:
    """A cluster that republishes its record, its wall clock ``skew`` seconds ahead of the reader's."""

    def __init__(self, rank: int = 2, skew: float = 0.0, started_at: float = 0.0):
        self.rank, self.skew, self.seq = rank, skew, 0
        self.started_at = WALL + skew + started_at
        self.record: dict = {}

    def publish(self, at: float) -> dict:
        """Publish at ``at`` on the reader's monotonic clock."""
        self.seq += 1
        self.record = {
            "galaxy_rank": self.rank,
            "state": "training",
            "started_at": self.started_at,
            "seq": self.seq,
            "published_at": WALL + at + self.skew,
            "heartbeat_seconds": 1.0,
        }
        return self.record


@pytest.mark.parametrize("skew", [-100.0, 100.0, 0.0])
def test_a_record_that_keeps_changing_stays_live_whatever_its_publishers_clock_says(skew):
    reader, cluster = Reader(), Publisher(skew=skew)
    for second in range(120):  # eight times the expiry, a fresh version before every read
        reader.now = float(second)
        seen = reader.read(cluster.publish(at=second - 0.5))[2]
        assert seen.is_live(EXPIRY), (second, seen)  # from the first read on (a first sighting is capped)
        assert seen.last_seen_seconds <= 1.0 or second == 0
    one_shot = Reader(expiry=None)  # what read_records(..., ages=None) makes of it: the old rule
    one_shot.now = reader.now
    assert (one_shot.read(cluster.record)[2].last_seen_seconds > EXPIRY) == (skew < -EXPIRY)  # gone for good


def test_a_first_sighting_gets_one_heartbeat_to_show_it_is_alive():
    dead = Publisher(skew=0.0).publish(at=-3600.0)  # a cluster that died an hour ago (its record lingers)
    rounds, status_board = Reader(), Reader(expiry=None)
    assert rounds.read(dead)[2].is_live(EXPIRY)  # might be a live cluster whose clock is an hour behind
    rounds.now = (
        1.0 + record_ages.PUBLISH_DELAY_SECONDS + 0.1
    )  # its heartbeat (1 s) and the publish delay passed
    assert departed([rounds.read(dead)[2]], EXPIRY) == {2}
    assert departed([status_board.read(dead)[2]], EXPIRY) == {2}  # open-diloco status: silent at once
    just_now = Publisher(skew=0.0).publish(at=-2.0)
    assert Reader().read(just_now)[2].last_seen_seconds == pytest.approx(
        2.0
    )  # clocks agree: exact, as before


@pytest.mark.parametrize("skew", [-100.0, 100.0, 0.0])
def test_a_record_that_stops_changing_is_departed_after_the_expiry_on_the_readers_clock(skew):
    reader, cluster = Reader(), Publisher(skew=skew)
    for second in range(10):
        reader.now = float(second)
        reader.read(cluster.publish(at=second - 0.5))
    last = cluster.record  # published at 8.5 on the reader's clock; the cluster dies
    # the reader places it at 9 (the read at 8 showed the one before, published 1 s earlier by its publisher's
    # clock): between two reads a reader errs on the alive side, by at most the time between them
    reader.now = 9.0 + EXPIRY
    assert departed([reader.read(last)[2]], EXPIRY) == set()
    reader.now = 9.0 + EXPIRY + 0.1
    assert departed([reader.read(last)[2]], EXPIRY) == {2}  # 100 s ahead: the old rule kept it 100 s longer


def test_a_cluster_that_died_just_after_a_read_is_gone_on_time_however_far_apart_reads_are():
    reader, dead, live = Reader(), Publisher(rank=1, skew=-100.0), Publisher(rank=2, skew=100.0)
    reader.read(dead.publish(at=0.0), live.publish(at=0.0))
    reader.now = 60.0  # one round later; cluster 1 published twice more (heartbeats at 5 s) and died
    dead.publish(at=5.0)
    seen = reader.read(dead.publish(at=10.0), live.publish(at=59.0))
    assert seen[1].last_seen_seconds == pytest.approx(50.0)  # by the publisher's clock differences: no skew
    assert departed(list(seen.values()), EXPIRY) == {1}


def test_an_older_copy_served_again_does_not_revive_a_dead_cluster():
    reader, cluster = Reader(), Publisher()
    older, newer = dict(cluster.publish(at=0.0)), dict(cluster.publish(at=1.0))
    reader.read(older)
    for second in range(
        1, 40
    ):  # two DHT nodes answer in turn, one of them lagging: the cluster itself is gone
        reader.now = float(second)
        seen = reader.read(newer if second % 2 else older)[2]
    assert seen.last_seen_seconds == pytest.approx(38.0) and departed([seen], EXPIRY) == {2}


def test_a_cluster_restarted_on_a_host_whose_clock_is_behind_is_news():
    reader, first = Reader(), Publisher(skew=0.0)
    reader.read(first.publish(at=0.0))
    reader.now = 30.0
    restarted = Publisher(
        skew=-100.0, started_at=25.0
    )  # another host; its record's dates are older than the last
    seen = reader.read(restarted.publish(at=29.0))[2]
    assert seen.last_seen_seconds <= 30.0  # not older than the read that did not show it yet
    reader.now = 31.0
    assert reader.read(restarted.publish(at=30.5))[2].last_seen_seconds == pytest.approx(0.0)


def test_a_skewed_publisher_is_named_in_one_warning_line(caplog):
    reader, behind, ahead, right = (
        Reader(),
        Publisher(1, skew=-31.2),
        Publisher(2, skew=40.0),
        Publisher(3, 0.5),
    )
    with caplog.at_level(logging.WARNING, logger=record_ages.__name__):
        for second in range(30):
            reader.now = float(second)
            reader.read(*(cluster.publish(at=second - 0.5) for cluster in (behind, ahead, right)))
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, (
        lines
    )  # one per skewed cluster, however many reads show it; none for half a second
    # each published 0.5 s before a read; what one read proves is a range that holds the true skew
    assert lines[0].startswith(
        "cluster 1's clock is 27.7 to 31.7 s behind this one's (a record it published at "
        "most 4.0 s ago is dated 31.7 s ago)"
    ), lines[0]
    assert lines[1].startswith(
        "cluster 2's clock is 39.5 to 43.5 s ahead of this one's (a record it published "
        "at most 4.0 s ago is dated 39.5 s in the future)"
    ), lines[1]
    assert all("keep every site on NTP; membership ages here do not depend on it" in line for line in lines)


def test_a_version_read_late_after_a_partition_is_no_proof_of_a_skew(caplog):
    # one clock (no skew). Cut off from t=10 to t=20, the reader reads the last version it had; after the heal
    # one read brings a version published during the cut (kept on the far side), dated 8.5 s ago where the
    # previous read was 1 s before: alone, that "proved" the publisher 4.5 s behind (the chaos soak's heals,
    # on one machine). The versions after it are fresh: nothing is named
    reader, cluster = Reader(), Publisher(1)
    with caplog.at_level(logging.WARNING, logger=record_ages.__name__):
        for second in range(10):
            reader.now = float(second)
            reader.read(cluster.publish(at=second - 0.5))
        kept = dict(cluster.record)
        during = {}
        for second in range(10, 21):
            reader.now = float(second)
            published = cluster.publish(at=second - 0.5)
            during.setdefault(second, dict(published))
            reader.read(kept)
        reader.now = 21.0
        reader.read(during[13])  # published at 12.5, read at last
        for second in range(22, 30):
            reader.now = float(second)
            reader.read(cluster.publish(at=second - 0.5))
    assert not caplog.records, [record.getMessage() for record in caplog.records]


class FakeDHT:
    """hivemind's DHT face that the publisher and the reader use (store and get of subkeyed records)."""

    def __init__(self, publisher_skew: float = 0.0):
        self.values: dict[int, SimpleNamespace] = {}
        self.skew, self.stored = publisher_skew, threading.Event()

    def store(self, key, value, expiration_time, subkey, return_future):
        self.values[subkey] = SimpleNamespace(
            value={**value, "published_at": value["published_at"] + self.skew}
        )
        self.stored.set()
        return _done(True)

    def get(self, key, latest, return_future):
        return _done(SimpleNamespace(value=dict(self.values)))


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_a_publishers_records_are_aged_by_the_reader_that_keeps_its_ages():
    dht = FakeDHT(publisher_skew=-100.0)  # this publisher's clock is 100 s behind
    identity = {"galaxy_rank": 1, "host": "h", "peer_id": "QmA", "shard_peer_ids": ["QmA"]}
    publisher = StatusPublisher(dht, "run", identity, heartbeat_seconds=0.02, expiry_seconds=EXPIRY)
    try:
        ages = RecordAges()  # as open-diloco status keeps it: the first read by the publisher's clock
        assert dht.stored.wait(5.0)
        first = read_records(dht, status.status_key("run"), 1.0, ages)
        assert first[0].last_seen_seconds > EXPIRY  # a first sighting: by the publisher's clock
        seqs = [first[0].seq]
        for _ in range(3):
            while dht.values[1].value["seq"] == seqs[-1]:
                threading.Event().wait(0.01)
            (record,) = read_records(dht, status.status_key("run"), 1.0, ages)
            seqs.append(record.seq)
            assert record.last_seen_seconds < 1.0 and record.is_live(EXPIRY), record
        assert seqs == sorted(set(seqs))  # a counter per publication
        published = record.to_wire()
        assert {"started_at", "published_at", "heartbeat_seconds", "member_expiry_seconds", "peer_id"} <= set(
            published
        )
        assert record.extra == {}  # every key the publisher writes is a field of the record
        assert (
            read_records(dht, status.status_key("run"), 1.0)[0].last_seen_seconds > EXPIRY
        )  # no ages: as before
    finally:
        publisher.close()
