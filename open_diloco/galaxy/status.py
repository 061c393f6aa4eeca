"""The galaxy's membership and status board: every cluster's rank 0 keeps one small record about its cluster
in the DHT. Rounds read them to know which clusters are gone (:func:`departed`: a round waits only for the
others), and ``open-diloco status`` reads them all (:mod:`open_diloco.status_view` judges them).

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
        with self._lock:
            self._seq += 1
            record = {**self._record, "published_at": get_dht_time(), "seq": self._seq}
            entries, self._ledger = self._ledger, []
        if entries and not store_entries(self.dht, self.run_id, entries, STORE_TIMEOUT):
            with self._lock:  # kept for the next publication (the newest last; a mirror: bounded)
                self._ledger = (entries + self._ledger)[-1024:]
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


SCHEMA_KEYS = ("model_fingerprint", "ranks", "codec", "fragments", "round_steps")
"""What clusters must share to average together: hivemind's matchmaking silently never groups peers whose
tensors differ (another model, another number of ranks, so other shard sizes) or whose wire differs
(codec)."""


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


def shard_peer(record: dict[str, Any], shard_index: int) -> str | None:
    """The PeerID of the averager of shard ``shard_index`` in the cluster of ``record``; ``None`` when the
    record does not name it (a record of a version before ``shard_peer_ids`` names rank 0's only)."""
    peers = record.get("shard_peer_ids") or [record.get("peer_id")]
    peer = peers[shard_index] if shard_index < len(peers) else None
    return str(peer) if peer else None


def schema_conflict(
    records: list[dict[str, Any]], galaxy_rank: int, schema: dict[str, Any], expiry: float
) -> str | None:
    """A line naming the first cluster whose record says it cannot average with this one, and what differs;
    ``None`` when all can. Only clusters heard from within ``expiry`` count (also one that just stopped over
    the same conflict, so that both sides are told): an old run's records under the same run id are no
    conflict."""
    for record in records:
        if record["galaxy_rank"] == galaxy_rank or record["last_seen_seconds"] > expiry:
            continue
        for key in SCHEMA_KEYS:
            if key in record and record[key] != schema[key]:
                fields = model_difference(schema.get("model_config"), record.get("model_config"))
                if key == "model_fingerprint" and fields:
                    what = f"its model differs ({fields})"
                else:
                    what = f"its {key} is {record[key]!r}, here {schema[key]!r}"
                who = f"cluster {record['galaxy_rank']} (host {record.get('host', '?')})"
                return (
                    f"{who} cannot average with this one: {what}; every cluster of a galaxy must train the "
                    "same model with the same number of ranks, --hv.compression, --hv.fragments and "
                    "--hv.round-steps (with `by-speed`, the same tokens per inner step)"
                )
    return None


def model_difference(here: dict[str, Any] | None, there: dict[str, Any] | None) -> str | None:
    """The model config fields that differ between this cluster (``here``) and another (``there``), as
    ``num_hidden_layers 3 here, 2 there``; ``None`` when either side published none (a record of an older
    version) or they agree (then the fingerprint is all that tells the models apart)."""
    if not here or not there:
        return None
    differ = [
        f"{key} {here.get(key, 'unset')} here, {there.get(key, 'unset')} there"
        for key in sorted(set(here) | set(there))
        if here.get(key) != there.get(key)
    ]
    return "; ".join(differ) or None


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

    def read(self) -> list[dict[str, Any]]:
        """Every cluster's latest record, by galaxy rank (see :func:`read_records`)."""
        return read_records(self.dht, self.key, self.timeout, self.ages)


def read_records(dht: DHT, key: str, timeout: float, ages: RecordAges | None = None) -> list[dict[str, Any]]:
    """Every cluster's latest record under ``key``, by galaxy rank; empty when none is found in ``timeout``.
    Each gains ``last_seen_seconds``: how long ago its cluster last refreshed it, measured by ``ages``, which
    a caller that reads again and again keeps across its reads (then on this machine's clock alone, see
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
    records = []
    for entry in found.value.values():
        if not isinstance(entry.value, dict) or not isinstance(entry.value.get("galaxy_rank"), int):
            continue  # not one of ours (another program under a key of the same name)
        records.append(dict(entry.value))
    (ages if ages is not None else RecordAges()).stamp(records, get_dht_time())
    return sorted(records, key=lambda record: record["galaxy_rank"])


def is_live(record: dict[str, Any], expiry: float) -> bool:
    """The record's cluster still trains and refreshed it within ``expiry`` seconds."""
    return record.get("state") == "training" and record["last_seen_seconds"] <= expiry


def previous_lives(records: list[dict[str, Any]], seen_training: set[int]) -> set[int]:
    """Galaxy ranks whose record says their run ended but that this process never saw training: the record a
    cluster left at the end of an earlier run (a galaxy stopped and resumed, a run id used again). Counted as
    gone, it let the first cluster back train its rounds alone while the others were still starting (seen in
    a resume test under load); until that cluster writes again it counts as having no record: alive, not yet
    heard from, serving nothing."""
    return {
        record["galaxy_rank"]
        for record in records
        if record.get("state") != "training" and record["galaxy_rank"] not in seen_training
    }


def no_reachable_cluster(records: list[dict[str, Any]], galaxy_size: int, expiry: float) -> bool:
    """Whether every cluster of the galaxy has a record (heard from within ``expiry``) and every one runs with
    ``--hv.client-mode``: then nobody can reduce a span, and matchmaking would never form a group (hivemind's
    client peers only join groups a reachable peer leads). Ended clusters count, as for
    :func:`schema_conflict`: the first to see it stops, and its record must not hide it from the others."""
    recent = [record for record in records if record["last_seen_seconds"] <= expiry]
    ranks = {record["galaxy_rank"] for record in recent}
    return len(ranks) >= galaxy_size and all(record.get("client_mode") for record in recent)


def finished_and_serving(record: dict[str, Any], expiry: float) -> bool:
    """The record's cluster finished its run within ``expiry`` seconds: it still serves its final state (its
    averager drains until the others are past its last round), so a cluster whose last average never came can
    take that round from it."""
    return record.get("state") == "finished" and record["last_seen_seconds"] <= expiry


def past_round(records: list[dict[str, Any]], round_id: int, ranks: frozenset[int], expiry: float) -> bool:
    """Every cluster in ``ranks`` has a record that shows an outer step past ``round_id`` (it holds that
    round's result, whole or partial), or says it stopped training, or is older than ``expiry``. A cluster
    without a record is not past it: the DHT may just not have answered."""
    by_rank = {record["galaxy_rank"]: record for record in records}
    return all(
        rank in by_rank
        and (int(by_rank[rank].get("outer_step", -1)) > round_id or not is_live(by_rank[rank], expiry))
        for rank in ranks
    )


def lead_outer_step(records: list[dict[str, Any]], expiry: float) -> int:
    """The highest outer step a live cluster's record shows (-1: none)."""
    return max((int(r.get("outer_step", -1)) for r in records if is_live(r, expiry)), default=-1)


def lead_progress(
    records: list[dict[str, Any]], expiry: float, galaxy_rank: int, lead: int
) -> tuple[int, float]:
    """``(inner_step, seconds since)`` of the live cluster (not ``galaxy_rank``) furthest into the round after
    the lead outer step ``lead`` (:func:`lead_outer_step`; ``(-1, 0.0)``: none known)."""
    at_lead = [
        r
        for r in records
        if is_live(r, expiry) and int(r.get("outer_step", -1)) == lead and r["galaxy_rank"] != galaxy_rank
    ]
    furthest = max(at_lead, key=lambda r: int(r.get("inner_step", -1)), default=None)
    if furthest is None:
        return -1, 0.0
    return int(furthest.get("inner_step", -1)), float(furthest["last_seen_seconds"])


def silent(records: list[dict[str, Any]], expiry: float) -> set[int]:
    """Galaxy ranks gone by silence alone: their record still says training but is older than ``expiry``."""
    return {
        record["galaxy_rank"]
        for record in records
        if record.get("state") == "training" and not is_live(record, expiry)
    }


def never_heard(records: list[dict[str, Any]], galaxy_size: int, galaxy_rank: int) -> set[int]:
    """Galaxy ranks other than ``galaxy_rank`` with no record among ``records``: clusters not started yet, or
    never coming."""
    return set(range(galaxy_size)) - {record["galaxy_rank"] for record in records} - {galaxy_rank}


def departed(records: list[dict[str, Any]], expiry: float) -> set[int]:
    """Galaxy ranks whose cluster is gone by its record: it said it ended, or it has been silent for longer
    than ``expiry``. A cluster with no record at all is not known to be gone (it may not have started yet)."""
    return {record["galaxy_rank"] for record in records if not is_live(record, expiry)}
