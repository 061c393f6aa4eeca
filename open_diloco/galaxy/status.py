"""The galaxy's membership and status board: every cluster's rank 0 keeps one small record about its cluster
in the DHT. Rounds read them to know which clusters are gone (a round waits only for the others), and
``open-diloco status`` reads them all (:mod:`open_diloco.status_view` judges them). This module is the I/O
alone: what a record holds, and the rules that judge records, are :mod:`open_diloco.membership_record`'s
(no hivemind there); the publisher writes a plain dict of its fields, which readers get back as a
``MemberRecord``.

Why the DHT: it is the one place every site of a galaxy already reaches, so the question "which cluster is
behind, and by how much?" needs no login anywhere and no central server. The records live under
``{run_id}/status``, one DHT subkey per galaxy rank, and expire by themselves after :data:`RECORD_TTL`: a
cluster that was killed outright keeps its last record until then, and the reader sees from its age that it
went silent.

The publisher refreshes the record from a thread of its own every ``--hv.heartbeat-interval`` seconds and
at once after every round, so a record's age says how long ago the cluster was last alive, independent of how
long a round takes. That age is measured on the reader's own clock (:class:`RecordAges`): two sites' clocks
need not agree for membership to hold. The training loop only hands over fields
(:meth:`StatusPublisher.update`, no I/O); only this thread talks to the DHT, so a slow or unreachable DHT
never stalls an inner step.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from open_diloco.galaxy.dht import DHT_PIPE_LOCK, shutdown_dht, start_dht
from open_diloco.galaxy.ledger_mirror import store_entries
from open_diloco.galaxy.record_ages import PUBLISH_DELAY_SECONDS, RecordAges
from open_diloco.membership_record import SCHEMA_KEYS, MemberRecord

log = logging.getLogger(__name__)

RECORD_TTL = 3600.0
"""Seconds a record outlives its cluster's last refresh: long enough for an operator to see which cluster
went silent, short enough that a finished run's records do not linger for days."""

STORE_TIMEOUT = PUBLISH_DELAY_SECONDS
"""Seconds one publication may take before it is given up (the next heartbeat tries again); readers allow for
it (:data:`~open_diloco.galaxy.record_ages.PUBLISH_DELAY_SECONDS`)."""
CLOSE_SECONDS = 3.0
"""What the final publication gets at the end of a run; on loopback or a sane link it takes milliseconds."""

# What the trainer's per-step records contribute to a status record (same names as the metrics contract).
_FROM_METRICS = (
    "loss",
    "tokens_per_second",
    "outer_step",
    "param_hash",
    "committed_work",
    "tokens_computed",
    "tokens_committed",
    "data_cursor",
    "data_committed_pages",
    "data_epoch",
    "roster",
    "in_sync",
    "galaxy_peers",
    "galaxy_alive",
    "allreduce_seconds",
    "bytes_sent",
    "bytes_received",
    "round_attempt",
    "inner_steps",
    "round_inner_steps",
    "round_weight",
    "inner_step_seconds",
)
"""A record's fields taken from the trainer's records. ``round_attempt`` (``[round, attempt]``, from the outer
loop at each attempt's start) lets a cluster join the galaxy's current attempt of a round instead of one
nobody is in."""


def status_key(run_id: str) -> str:
    """The DHT key under which every cluster of run ``run_id`` keeps its record (subkey: its galaxy rank)."""
    return f"{run_id}/status"


class StatusPublisher:
    """Keeps this cluster's record in the DHT (run on the cluster's global rank 0 only).

    ``identity`` holds what does not change during a run (galaxy rank, host, ranks, codec, H, version)."""

    def __init__(
        self, dht: DHT, run_id: str, identity: dict[str, Any], heartbeat_seconds: float, expiry_seconds: float
    ):
        self.dht, self.key, self.run_id = dht, status_key(run_id), run_id
        self._ledger: list[dict[str, Any]] = []
        """Ledger entries of rounds this cluster committed, not yet mirrored (``galaxy/ledger_mirror.py``)."""
        self.heartbeat_seconds = heartbeat_seconds
        self._record: dict[str, Any] = {
            **identity,
            "state": "training",
            "inner_step": 0,
            "outer_step": 0,
            "started_at": get_dht_time(),
            "heartbeat_seconds": heartbeat_seconds,
            "member_expiry_seconds": expiry_seconds,
        }
        self._seq = 0  # counts publications: readers tell a new one from an old one without comparing clocks
        self._lock = threading.Lock()
        self._publish_now = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="galaxy-status", daemon=True)
        self._thread.start()

    def update(self, step_record: dict[str, Any]) -> None:
        """Take the trainer's record of one inner step (the metrics record); after a round, publish at
        once."""
        fields = {key: step_record[key] for key in _FROM_METRICS if key in step_record}
        if "step" in step_record:
            fields["inner_step"] = step_record["step"]
        if "state" in step_record:
            fields["state"] = step_record["state"]
        with self._lock:
            if isinstance(entry := step_record.get("ledger"), dict):
                self._ledger.append(entry)
            if "outer_step" in step_record:
                now = get_dht_time()
                previous = self._record.get("round_ended_at")
                if previous is not None:
                    fields["round_wall_seconds"] = now - previous
                fields["round_ended_at"] = now
            self._record.update(fields)
        if "outer_step" in step_record or "state" in step_record or "round_attempt" in step_record:
            self._publish_now.set()

    def close(self) -> None:
        """Publish the final record (its ``state`` says how the run ended) and stop: at most
        :data:`CLOSE_SECONDS`, inside the trainer's stop grace, whatever the DHT does."""
        self._closed.set()
        self._publish_now.set()
        self._thread.join(CLOSE_SECONDS)

    def _run(self) -> None:
        while True:
            closing = (
                self._closed.is_set()
            )  # read first: the publication after close() carries the final state
            self._publish()
            if closing:
                return
            self._publish_now.wait(self.heartbeat_seconds)
            self._publish_now.clear()

    def _publish(self) -> None:
        """The record first (membership reads its age), then the ledger entries since the last one."""
        with self._lock:
            self._seq += 1
            record = {**self._record, "published_at": get_dht_time(), "seq": self._seq}
            entries, self._ledger = self._ledger, []
        self._store_record(record)
        if entries and not store_entries(self.dht, self.run_id, entries, STORE_TIMEOUT):
            with self._lock:  # kept for the next publication (the newest last; a mirror: bounded)
                self._ledger = (entries + self._ledger)[-1024:]

    def _store_record(self, record: dict[str, Any]) -> None:
        try:
            with DHT_PIPE_LOCK:
                stored = self.dht.store(
                    self.key,
                    record,
                    expiration_time=record["published_at"] + RECORD_TTL,
                    subkey=record["galaxy_rank"],
                    return_future=True,
                )
            stored = stored.result(timeout=STORE_TIMEOUT)
        except Exception as err:  # the DHT is slow, gone or shutting down: the next heartbeat tries again
            log.debug("status record not published: %r", err)
            return
        if not stored:
            log.debug("status record not stored (no DHT peer took it)")


def cluster_identity(
    galaxy_rank: int, schema: dict[str, Any], local_steps: int, version: str, shard_peer_ids: Sequence[str]
) -> dict[str, Any]:
    """The fixed part of a cluster's record: who it is, its :data:`SCHEMA_KEYS`, and the model config's fields
    that decide the fingerprint (``model_config``, to say what differs when fingerprints do).

    ``shard_peer_ids``: the PeerID of each local rank's averager, in rank order. Shard k averages with shard k
    of every other cluster, each over a connection of its own, so a cluster that heals a partition must reach
    every shard's peer, not only rank 0's (``peer_id``, kept as it was for ``status`` and the allowlist)."""
    return {
        "galaxy_rank": galaxy_rank,
        "host": socket.gethostname(),
        **{key: schema[key] for key in SCHEMA_KEYS if key in schema},
        "model_config": schema.get("model_config", {}),
        "local_steps": local_steps,
        "version": version,
        "peer_id": shard_peer_ids[0],
        "shard_peer_ids": list(shard_peer_ids),
    }


class StatusReader:
    """A DHT client (it never takes part in a round) that reads every cluster's record of one run; a context
    manager, so that ``--watch`` joins the DHT once and every exit leaves it.

    It keeps one :class:`RecordAges` across reads: a single read (``open-diloco status``) ages records by the
    publisher's clock, as a first sighting must; with ``--watch`` every later read ages them on this machine's
    clock and names a publisher whose clock is off in one warning line."""

    def __init__(self, initial_peers: Sequence[str], run_id: str, timeout: float):
        self.key, self.timeout = status_key(run_id), timeout
        self.ages = RecordAges()
        self.dht = start_dht(initial_peers, ["/ip4/127.0.0.1/tcp/0"], [], timeout, client_mode=True)

    def __enter__(self) -> StatusReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        shutdown_dht(self.dht)

    def read(self) -> list[MemberRecord]:
        """Every cluster's latest record, by galaxy rank (see :func:`read_records`)."""
        return read_records(self.dht, self.key, self.timeout, self.ages)


def read_records(dht: DHT, key: str, timeout: float, ages: RecordAges | None = None) -> list[MemberRecord]:
    """Every cluster's latest record under ``key``, by galaxy rank; empty when none is found in ``timeout``.
    Each carries ``last_seen_seconds``: how long ago its cluster last refreshed it, measured by ``ages``,
    which a caller that reads again and again keeps across its reads (then on this machine's clock alone, see
    :class:`RecordAges`). Without ``ages`` every record is a first sighting: aged by the publisher's clock."""
    try:
        with DHT_PIPE_LOCK:
            found = dht.get(key, latest=True, return_future=True)
        found = found.result(timeout=timeout)
    except Exception as err:  # slow, unreachable or shutting down: nothing known
        log.debug("status records not read: %r", err)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    # None: not one of ours (another program under a key of the same name)
    records = [
        record
        for entry in found.value.values()
        if (record := MemberRecord.from_wire(entry.value)) is not None
    ]
    records = (ages if ages is not None else RecordAges()).stamp(records, get_dht_time())
    return sorted(records, key=lambda record: record.galaxy_rank)
