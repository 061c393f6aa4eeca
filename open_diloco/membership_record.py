"""One cluster's membership record, typed (:class:`MemberRecord`), and the pure rules that judge the galaxy's
records: who is live, gone, silent, leading, or cannot average with this cluster.

Every cluster's rank 0 publishes a record into the DHT (``galaxy/status.py``: the only I/O); the rounds
(``galaxy/averager.py``), the cut-off watch and ``open-diloco status`` read it. Each reader used to pick keys
out of a raw dict, each with its own default for a missing key; here every field is named once, with what it
means and what an older version that did not publish it counts as. No hivemind and no torch: the rules are
tested on records built in code.

The wire stays a plain dict with the same keys as before, since other versions read it:
:meth:`MemberRecord.to_wire` gives back exactly what :meth:`MemberRecord.from_wire` read, keys a newer version
adds included.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MemberRecord:
    """What one cluster says about itself (its rank 0 refreshes it every heartbeat and after every round), and
    how long ago this reader last saw it refreshed."""

    galaxy_rank: int
    """The cluster's ``--hv.world-rank``: the record's DHT subkey."""
    state: str | None = None
    """``training``, ``finished``, or how the run stopped (``stopped (SIGTERM)``, ``failed (…)``)."""
    host: str | None = None
    """The hostname of the cluster's rank 0."""
    ranks: int | None = None
    """How many ranks (shards) the cluster has."""
    inner_step: int = -1
    """Inner steps the cluster has taken (-1: not said)."""
    outer_step: int = -1
    """Rounds the cluster holds the result of (-1: not said)."""
    param_hash: str | None = None
    """The hash of the cluster's θ_outer after its last round."""
    committed_work: int | None = None
    """The committed work of the ledger chain that ends at that θ_outer (``LedgerEntry.work``; ``None``: not
    said, counted as 0): which of two forks the galaxy keeps."""
    in_sync: bool | None = None
    """Whether its last round started from the same θ_outer as every other cluster in it."""
    loss: float | None = None
    """The cluster's last training loss."""
    tokens_per_second: float | None = None
    """The cluster's last inner step's throughput."""
    tokens_computed: int | None = None
    """Tokens of every inner step the cluster trained (``outer/goodput.py``)."""
    tokens_committed: int | None = None
    data_cursor: int | None = None
    """An elastic galaxy: the first page its chain's deal never dealt (``outer/deal.py``)."""
    data_committed_pages: int | None = None
    """An elastic galaxy: the pages its chain committed."""
    data_epoch: float | None = None
    """An elastic galaxy on a corpus: the passes over the training set the deal's cursor has made."""
    """Tokens of its own in the ledger chain it holds: what of its work the galaxy committed."""
    cluster_id: str | None = None
    """Its id in an elastic galaxy (``--hv.cluster-id``, or the one kept in ``--ckpt.path``), whose hash is
    its galaxy rank; ``None`` in a fixed galaxy."""
    roster: list[int] | None = None
    """The roster its ledger chain names (``outer/quorum.py``): the clusters whose majority its next round
    needs."""
    galaxy_peers: int | None = None
    """Clusters in its last round's group."""
    galaxy_alive: int | None = None
    """Clusters it counted as live at its last round."""
    allreduce_seconds: float | None = None
    """How long its last round's all-reduce took."""
    bytes_sent: float | None = None
    """Bytes its rank 0 sent in its last round."""
    bytes_received: float | None = None
    """Bytes its rank 0 received in its last round."""
    round_attempt: list[int] | None = None
    """``[round, attempt]`` the cluster is in now: a joiner takes the galaxy's attempt (:attr:`attempt`)."""
    inner_steps: int | None = None
    """Inner steps its last round's Δ covered."""
    round_inner_steps: int | None = None
    """``--hv.round-steps by-speed``: the inner steps it took in its last round."""
    round_weight: float | None = None
    """``--hv.round-steps by-speed``: the weight its Δ entered the average with."""
    inner_step_seconds: float | None = None
    """Its measured seconds per inner step, by which the others plan their rounds (:attr:`step_seconds`)."""
    shard_peer_ids: list[str] = field(default_factory=list)
    """The PeerID of each rank's averager, in rank order (empty: a version that named rank 0's only)."""
    peer_id: str | None = None
    """Rank 0's averager's PeerID: what the allowlist and ``status`` name the cluster by."""
    client_mode: bool = False
    """Some rank of the cluster runs in client mode: nobody can dial it, so it serves no state."""
    model_fingerprint: str | None = None
    """The model's parameter names and shapes, hashed: clusters average only with equal ones."""
    codec: str | None = None
    """The wire codec (``--hv.compression``), which every cluster of a galaxy must share."""
    fragments: int | None = None
    """``--hv.fragments``, which every cluster of a galaxy must share."""
    round_steps: str | None = None
    """``--hv.round-steps`` (``by-speed``: and the tokens of an inner step), which all clusters must share."""
    membership: str | None = None
    """``fixed`` (ranks by ``--hv.world-rank``) or ``elastic`` (ids): one galaxy cannot mix them (a fixed
    cluster counts ranks 0 … N − 1 and would not see an elastic one in its live count)."""
    model_config: dict[str, Any] | None = None
    """The model config's fields that decide the fingerprint: they say what differs when fingerprints do."""
    local_steps: int | None = None
    """H, ``--hv.local-steps``."""
    version: str | None = None
    """The open_diloco version line the cluster runs."""
    started_at: float | None = None
    """When the cluster's run started (its clock): tells a restart (new incarnation) from a republication."""
    published_at: float | None = None
    """When this version of the record was published (its clock; ages never compare it with this reader's)."""
    seq: int | None = None
    """Counts the cluster's publications in this incarnation: a higher one is news."""
    heartbeat_seconds: float | None = None
    """The cluster's ``--hv.heartbeat-interval``: how often it refreshes the record."""
    member_expiry_seconds: float | None = None
    """The cluster's ``--hv.member-expiry``: silence after which it counts as gone (:attr:`silent_after`)."""
    round_ended_at: float | None = None
    """When its last round ended (its clock)."""
    round_wall_seconds: float | None = None
    """Seconds between its last two rounds' ends."""
    last_seen_seconds: float = 0.0
    """How long ago the cluster last refreshed the record, on the reader's clock (``galaxy/record_ages.py``):
    stamped at each read, never published."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not read (a newer version's, or an ill-typed value of a field): kept, so that
    :meth:`to_wire` and ``status --json`` lose nothing."""
    wire_keys: frozenset[str] = frozenset()
    """The fields the wire carried, so that :meth:`to_wire` gives back what was read and invents no key."""

    @classmethod
    def from_wire(cls, value: Any) -> MemberRecord | None:
        """The record in ``value`` (a dict as read from the DHT); ``None`` when it is not one of ours (no int
        ``galaxy_rank``: another program under a key of the same name). A missing field (an older version)
        keeps its default; an ill-typed one too, its value kept in :attr:`extra`."""
        if not isinstance(value, dict) or not _accepts(int, value.get("galaxy_rank")):
            return None
        typed = {
            key: item
            for key, item in value.items()
            if key in _WIRE_HINTS and _accepts(_WIRE_HINTS[key], item)
        }
        extra = {key: item for key, item in value.items() if key not in typed}
        return cls(**typed, extra=extra, wire_keys=frozenset(typed))

    def to_wire(self) -> dict[str, Any]:
        """The record as published: the fields read from the wire or set since, and :attr:`extra`; never
        :attr:`last_seen_seconds` (each reader stamps its own)."""
        wire = {
            name: getattr(self, name)
            for name, default in _WIRE_DEFAULTS.items()
            if name in self.wire_keys or getattr(self, name) != default
        }
        return {**self.extra, **wire}  # a field set since replaces an ill-typed value read

    @property
    def training(self) -> bool:
        """The cluster says it trains (it has not finished or stopped)."""
        return self.state == "training"

    def is_live(self, expiry: float) -> bool:
        """The cluster still trains and refreshed its record within ``expiry`` seconds."""
        return self.training and self.last_seen_seconds <= expiry

    def finished_and_serving(self, expiry: float) -> bool:
        """The cluster finished its run within ``expiry`` seconds: it still serves its final state (its
        averager drains until the others are past its last round), so a cluster whose last average never came
        can take that round from it."""
        return self.state == "finished" and self.last_seen_seconds <= expiry

    def shard_peer(self, shard_index: int) -> str | None:
        """The PeerID of the averager of shard ``shard_index``; ``None`` when the record does not name it (a
        version before ``shard_peer_ids`` names rank 0's only)."""
        peers = self.shard_peer_ids or [self.peer_id]
        peer = peers[shard_index] if shard_index < len(peers) else None
        return str(peer) if peer else None

    @property
    def attempt(self) -> tuple[int, int] | None:
        """``(round, attempt)`` the cluster is in; ``None`` when the record does not say."""
        if self.round_attempt is None or len(self.round_attempt) != 2:
            return None
        return int(self.round_attempt[0]), int(self.round_attempt[1])

    @property
    def step_seconds(self) -> float | None:
        """The cluster's seconds per inner step, when it published a measured one (> 0)."""
        seconds = self.inner_step_seconds
        return float(seconds) if seconds is not None and seconds > 0 else None

    @property
    def silent_after(self) -> float:
        """Seconds without a refresh after which ``open-diloco status`` calls the cluster silent: its own
        ``--hv.member-expiry`` (the rule by which the rounds stop waiting for it), else 3 heartbeats."""
        heartbeat = 5.0 if self.heartbeat_seconds is None else self.heartbeat_seconds
        return float(self.member_expiry_seconds or 3 * float(heartbeat))


_READER_FIELDS = frozenset({"last_seen_seconds", "extra", "wire_keys"})
"""Fields of a record that no publisher writes."""
_WIRE_HINTS = {
    name: hint for name, hint in typing.get_type_hints(MemberRecord).items() if name not in _READER_FIELDS
}
"""Each published field's type, which a wire value must have to fill it."""
_WIRE_DEFAULTS = {
    spec.name: spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
    for spec in dataclasses.fields(MemberRecord)
    if spec.name not in _READER_FIELDS
}
"""Each published field's default: what a record built in code leaves out of :meth:`MemberRecord.to_wire`."""
WIRE_FIELDS = frozenset(_WIRE_HINTS)
"""Every key a publisher of this version writes (``galaxy/status.py``)."""


def _accepts(hint: Any, value: Any) -> bool:
    """``value`` fits the type ``hint`` (an int fits a float; a bool fits neither)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in args)
    if hint is type(None):
        return value is None
    if isinstance(value, bool) and hint is not bool:
        return False
    if hint is float:
        return isinstance(value, (int, float))
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_accepts(args[0], item) for item in value)
    return isinstance(value, origin or hint)


# -- the rules over every cluster's record ------------------------------------------------------------------
SCHEMA_KEYS = ("model_fingerprint", "ranks", "codec", "fragments", "round_steps", "membership")
"""What clusters must share to average together: hivemind's matchmaking silently never groups peers whose
tensors differ (another model, another number of ranks, so other shard sizes) or whose wire differs
(codec)."""


def schema_conflict(
    records: list[MemberRecord], galaxy_rank: int, schema: dict[str, Any], expiry: float
) -> str | None:
    """A line naming the first cluster whose record says it cannot average with this one, and what differs;
    ``None`` when all can. Only clusters heard from within ``expiry`` count (also one that just stopped over
    the same conflict, so that both sides are told): an old run's records under the same run id are no
    conflict. A schema key is compared as published, ill-typed or not: a value this version cannot read is
    a conflict too."""
    for record in records:
        if record.galaxy_rank == galaxy_rank or record.last_seen_seconds > expiry:
            continue
        published = record.to_wire()
        for key in SCHEMA_KEYS:
            if key in published and published[key] != schema[key]:
                fields = model_difference(schema.get("model_config"), record.model_config)
                if key == "model_fingerprint" and fields:
                    what = f"its model differs ({fields})"
                else:
                    what = f"its {key} is {published[key]!r}, here {schema[key]!r}"
                who = f"cluster {record.galaxy_rank} (host {record.host or '?'})"
                return (
                    f"{who} cannot average with this one: {what}; every cluster of a galaxy must train the "
                    "same model with the same number of ranks, --hv.compression, --hv.fragments and "
                    "--hv.round-steps (with `by-speed`, the same tokens per inner step), and give every "
                    "cluster a --hv.world-rank or none (elastic: then the same --hv.local-steps and tokens "
                    "per inner step, the size of a page the ledger deals)"
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


def previous_lives(records: list[MemberRecord], seen_training: set[int]) -> set[int]:
    """Galaxy ranks whose record says their run ended but that this process never saw training: the record a
    cluster left at the end of an earlier run (a galaxy stopped and resumed, a run id used again). Counted as
    gone, it let the first cluster back train its rounds alone while the others were still starting (seen in
    a resume test under load); until that cluster writes again it counts as having no record: alive, not yet
    heard from, serving nothing."""
    return {
        record.galaxy_rank
        for record in records
        if not record.training and record.galaxy_rank not in seen_training
    }


def no_reachable_cluster(records: list[MemberRecord], galaxy_size: int, expiry: float) -> bool:
    """Whether every cluster of the galaxy has a record (heard from within ``expiry``) and every one runs with
    ``--hv.client-mode``: then nobody can reduce a span, and matchmaking would never form a group (hivemind's
    client peers only join groups a reachable peer leads). Ended clusters count, as for
    :func:`schema_conflict`: the first to see it stops, and its record must not hide it from the others."""
    recent = [record for record in records if record.last_seen_seconds <= expiry]
    ranks = {record.galaxy_rank for record in recent}
    return len(ranks) >= galaxy_size and all(record.client_mode for record in recent)


def past_round(records: list[MemberRecord], round_id: int, ranks: frozenset[int], expiry: float) -> bool:
    """Every cluster in ``ranks`` has a record that shows an outer step past ``round_id`` (it holds that
    round's result, whole or partial), or says it stopped training, or is older than ``expiry``. A cluster
    without a record is not past it: the DHT may just not have answered."""
    by_rank = {record.galaxy_rank: record for record in records}
    return all(
        rank in by_rank and (by_rank[rank].outer_step > round_id or not by_rank[rank].is_live(expiry))
        for rank in ranks
    )


def chain_weight(record: MemberRecord) -> tuple[int, int]:
    """``(committed work, outer step)``: how far ahead a cluster's chain is, the most committed work first,
    the furthest outer step among equals. Why work first: after a split, a lighter fork (a side that committed
    alone, cheaply) can be further in rounds than the side that kept the galaxy's work."""
    return record.committed_work or 0, record.outer_step


def lead_of(records: list[MemberRecord], expiry: float) -> tuple[int, int]:
    """``(outer step, committed work)`` of the live cluster ahead of all (:func:`chain_weight`; ``(-1, 0)``:
    none)."""
    work, step = max((chain_weight(record) for record in records if record.is_live(expiry)), default=(0, -1))
    return step, work


def lead_progress(
    records: list[MemberRecord], expiry: float, galaxy_rank: int, lead: int
) -> tuple[int, float]:
    """``(inner_step, seconds since)`` of the live cluster (not ``galaxy_rank``) furthest into the round after
    the lead outer step ``lead`` (:func:`lead_of`; ``(-1, 0.0)``: none known)."""
    at_lead = [
        record
        for record in records
        if record.is_live(expiry) and record.outer_step == lead and record.galaxy_rank != galaxy_rank
    ]
    furthest = max(at_lead, key=lambda record: record.inner_step, default=None)
    if furthest is None:
        return -1, 0.0
    return furthest.inner_step, float(furthest.last_seen_seconds)


def silent(records: list[MemberRecord], expiry: float) -> dict[int, float]:
    """Galaxy ranks gone by silence alone (their record still says training but is older than ``expiry``),
    each with how long it has been silent."""
    return {
        record.galaxy_rank: float(record.last_seen_seconds)
        for record in records
        if record.training and not record.is_live(expiry)
    }


def never_heard(records: list[MemberRecord], galaxy_size: int, galaxy_rank: int) -> set[int]:
    """Galaxy ranks other than ``galaxy_rank`` with no record among ``records``: clusters not started yet, or
    never coming."""
    return set(range(galaxy_size)) - {record.galaxy_rank for record in records} - {galaxy_rank}


def departed(records: list[MemberRecord], expiry: float) -> set[int]:
    """Galaxy ranks whose cluster is gone by its record: it said it ended, or it has been silent for longer
    than ``expiry``. A cluster with no record at all is not known to be gone (it may not have started yet)."""
    return {record.galaxy_rank for record in records if not record.is_live(expiry)}
