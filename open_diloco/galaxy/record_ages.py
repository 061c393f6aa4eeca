"""How old each cluster's status record is, on the reader's own clock (:class:`RecordAges`): the galaxy's
membership (who counts as gone, :mod:`open_diloco.galaxy.status`) must not depend on two sites' clocks
agreeing. No hivemind here: the records come in as :class:`~open_diloco.membership_record.MemberRecord`, with
the reader's wall clock at the read."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from open_diloco.membership_record import MemberRecord

log = logging.getLogger(__name__)

SKEW_WARNING_SECONDS = 2.0
"""A publisher's clock proven this far off this machine's is named in a warning: membership ages do not depend
on it, but hivemind's matchmaking and DHT expiry compare clocks at the scale of ``--hv.matchmaking-time``."""
SKEW_PROOFS = 3
"""New versions in a row that must each prove a skew before it is named. Why: a version can be readable later
than :data:`PUBLISH_DELAY_SECONDS` after its publication after all (published on the far side of a partition,
or kept by a DHT node that another read did not reach), and then one read "proves" a skew that is not there:
after the heals of the chaos soak, on one machine and one clock, clusters were said to be 2.4-6.4 s behind.
A real skew shows in every version."""
PUBLISH_DELAY_SECONDS = 3.0
"""How long a publication may take to become readable (the publisher gives one up after this long,
``status.STORE_TIMEOUT``): a version first read now may date from this long before the previous read."""


class RecordAges:
    """Ages of the clusters' records on this reader's own clock (``time.monotonic``), kept across its reads.

    Why: ``published_at`` is the publisher's wall clock; comparing it with the reader's made a skew beyond
    ``--hv.member-expiry`` a silent split (every other cluster looked gone) or kept a dead cluster alive. Here
    a record's age is ``now − when its current version was published``, that moment placed on this reader's
    clock: publishers republish every heartbeat, so a record that keeps changing is alive whatever its date
    says.

    - A new version (a higher ``seq`` in the same incarnation, ``started_at``; see :func:`_newer`): the
      version before it was published by the last read that showed it, at ``R``, so the new one was published
      by ``R`` plus the time between the two on the publisher's clock (a difference of one clock: skew
      cancels), and not after now. A cluster that died just after a read is thus gone on time however long
      reads are apart, and a copy a lagging DHT node serves again is no news. A new incarnation (a restart)
      ages like a first sighting, but never from before ``R``.
    - The same version again: its age grows on this clock.
    - A first sighting (this reader just started, or the cluster is new) has nothing to compare with: its age
      is its publisher-clock age (at least 0), exact when clocks agree. A reader that judges membership
      (``expiry`` given: the rounds') caps it so that the record still has one heartbeat (+ the publish delay)
      to show a new version before it counts as gone: a live cluster whose clock is far behind is then never
      taken for gone, and a long-dead one (records outlive it by an hour) is gone after that one heartbeat.
      Without ``expiry`` (``open-diloco status``, which judges by each record's own expiry) a dead cluster
      shows at once as silent.

    Skew: a new version was not readable at the previous read, so it is at most (time since then +
    :data:`PUBLISH_DELAY_SECONDS`) old, and at least as old as the estimate above; a publisher-clock age
    outside that range proves a skew. One beyond :data:`SKEW_WARNING_SECONDS`, proven by :data:`SKEW_PROOFS`
    new versions in a row, is named in one warning line per cluster."""

    def __init__(self, expiry: float | None = None, clock: Callable[[], float] = time.monotonic):
        self._expiry, self._clock = expiry, clock
        self._lock = threading.Lock()  # a round's polls and the drain at shutdown may read from two threads
        self._known: dict[
            int, tuple[dict[str, Any], float, float]
        ] = {}  # rank: (version, published, last read)
        self._incarnations: dict[int, set[Any]] = {}  # rank: every started_at read (a restart is news once)
        self._warned: set[int] = set()
        self._proofs: dict[int, int] = {}  # rank: new versions in a row that proved a skew

    def stamp(self, records: list[MemberRecord], wall_now: float) -> list[MemberRecord]:
        """``records`` with each one's ``last_seen_seconds`` set (new records: they are frozen);
        ``wall_now``: this machine's ``get_dht_time()`` at the read (what a first sighting's ``published_at``
        is compared with)."""
        now = self._clock()
        stamped = []
        with self._lock:
            for record in records:
                published_at = wall_now if record.published_at is None else record.published_at
                age = max(0.0, now - self._published(record, wall_now - float(published_at), now))
                stamped.append(dataclasses.replace(record, last_seen_seconds=age))
        return stamped

    def _published(self, record: MemberRecord, clock_age: float, now: float) -> float:
        """When the record's current version was published, on this reader's clock; notes this read."""
        rank = record.galaxy_rank
        version = {"started_at": record.started_at, "seq": record.seq, "published_at": record.published_at}
        known = self._known.get(rank)
        incarnations = self._incarnations.setdefault(rank, set())
        if known is None:
            published = now - self._first_age(record, clock_age)
        elif _newer(version, known[0], incarnations):
            old, _, last_read = known
            between = float(version["published_at"] or 0.0) - float(old["published_at"] or 0.0)
            # a restart, or a clock stepped back
            if version["started_at"] != old["started_at"] or between < 0:
                published = max(last_read, now - self._first_age(record, clock_age))  # not readable before
            else:
                published = min(now, last_read + between)
            self._check_skew(rank, clock_age, youngest=now - published, oldest=now - last_read)
        else:
            version, published = known[0], known[1]
        self._known[rank] = (version, published, now)
        incarnations.add(version["started_at"])
        return published

    def _first_age(self, record: MemberRecord, clock_age: float) -> float:
        """The age of a record never read before: by its publisher's clock, capped (with ``expiry``) so that
        it counts as live for one more heartbeat at least."""
        if self._expiry is None:
            return max(0.0, clock_age)
        grace = min(self._expiry, float(record.heartbeat_seconds or 0.0) + PUBLISH_DELAY_SECONDS)
        return min(max(0.0, clock_age), self._expiry - grace)

    def _check_skew(self, rank: int, clock_age: float, youngest: float, oldest: float) -> None:
        """Warn once per cluster when a version that just appeared, whose true age lies between ``youngest``
        and ``oldest`` (+ :data:`PUBLISH_DELAY_SECONDS`), proves its publisher's clock off by more than
        :data:`SKEW_WARNING_SECONDS`, as the :data:`SKEW_PROOFS` - 1 new versions before it did."""
        oldest += PUBLISH_DELAY_SECONDS
        behind, ahead = (
            clock_age - oldest,
            youngest - clock_age,
        )  # the least skew each way that the read proves
        proven = max(behind, ahead) > SKEW_WARNING_SECONDS
        self._proofs[rank] = self._proofs.get(rank, 0) + 1 if proven else 0
        if rank in self._warned or self._proofs[rank] < SKEW_PROOFS:
            return
        self._warned.add(rank)
        dated = f"{clock_age:.1f} s ago" if clock_age >= 0 else f"{-clock_age:.1f} s in the future"
        off = (
            f"{behind:.1f} to {clock_age - youngest:.1f} s behind"
            if behind > 0
            else f"{ahead:.1f} to {oldest - clock_age:.1f} s ahead of"
        )
        off += f" this one's (a record it published at most {oldest:.1f} s ago is dated {dated})"
        log.warning(
            "cluster %d's clock is %s: keep every site on NTP; membership ages here do not depend on it, "
            "hivemind's matchmaking and DHT expiry do",
            rank,
            off,
        )


def _newer(version: dict[str, Any], known: dict[str, Any], incarnations: set[Any]) -> bool:
    """``version`` of a record is a later publication than ``known`` (see :class:`RecordAges`): from an
    incarnation of its cluster never read before (a restart, perhaps on a host with another clock), else a
    higher ``seq``, else (a record without one) a later ``published_at``: one clock compared with itself."""
    if version["started_at"] != known["started_at"]:
        return version["started_at"] not in incarnations
    if None not in (version["seq"], known["seq"]):
        return int(version["seq"]) > int(known["seq"])
    return float(version["published_at"] or 0.0) > float(known["published_at"] or 0.0)
