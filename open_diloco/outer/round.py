"""A round of one cluster: what is in flight, what its shards saw of it (agreed by every rank), and what it
came to (:class:`RoundResult`, the one object the trainer acts on and the metrics records are made from).

The commit rule lives here. A cluster *commits* a round (applies the average its reducers sent) only when
every shard's average arrived whole and every shard's group held the same clusters: then every cluster that
commits holds the reducers' exact bytes, by construction. Otherwise it never applies its own partial values;
it adopts the round from a cluster that committed it, or runs the round again under the next attempt
(``outer/diloco.py``). Why: with one average lost on one shard, "apply what arrived" left one cluster a model
no other cluster held, and the repairs after the fact (re-syncs a round later) cascaded on lossy links.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.ledger import LedgerEntry
from open_diloco.outer.protocols import PendingRound, RoundReport


@dataclass
class RoundInFlight:
    """A started round: what :meth:`DiLoCo.finish_round` needs to judge and apply it."""

    pending: PendingRound | None
    """The all-reduce in flight; ``None`` when it could not even start."""
    own_hash: str
    """Hash of this shard's θ_outer when the round started."""
    local_sq: float
    """‖Δ‖² of this shard before averaging (for the ``pseudo_grad_norm`` metric)."""
    alive: int
    """Clusters alive when the round started (membership), this one included; agreed by the cluster's
    ranks."""
    attempts: int = 0
    """The round's attempt (0 first): part of its matchmaking key, so attempts never meet each other."""
    start_error: str | None = None
    diverged: bool = False
    """Δ is not finite on some rank of this cluster: nothing was sent (the cluster sits the round out)."""
    bound: float | None = None
    """The largest ‖Δ‖ this shard could send this round (``guard.NormHistory``); ``None``: the check is
    off."""
    out_of_bound: bool = False
    """Δ is finite but out of bound on some rank of this cluster: nothing was sent (it sits the round out)."""
    lead: int = -1
    """The highest outer step a live cluster has applied, by the membership records (agreed by the ranks);
    above this cluster's, its Δ would come from an older θ_outer than the round's: nothing is sent."""
    silent: int = 0
    """Other clusters gone silent (not ended) when the round started (membership), the most any rank saw."""
    lands_at: int = 0
    """The inner step after which the round's update lands (its start + ``--hv.sync-delay``)."""

    @property
    def sits_out(self) -> bool:
        return self.pending is None and self.start_error is None


@dataclass(frozen=True)
class RoundView:
    """One round as every shard of the cluster saw it, the same on every rank (:meth:`agree`)."""

    whole: bool
    """Every shard's average arrived whole (no failed reducer, no lost part, a result at all)."""
    same_group: bool
    """Every shard's group held the same clusters."""
    group: frozenset[int]
    """The clusters of rank 0's shard's group (this one included)."""
    overtaken: bool
    """Some shard saw, while it looked for a group, that the galaxy already applied this round without it."""
    rejected: list[int]
    """Clusters some reducer left out as garbage (guard)."""
    stale: list[int]
    """Clusters some reducer left out for starting from another θ_outer than the round's most advanced
    peer."""
    in_sync: bool
    """Every shard's peers (less the stale ones) started from this cluster's θ_outer."""
    left_out: bool
    """Some shard's reducers left this very cluster out as stale: it must take the round's reference peer's
    state (retrying cannot help: its next Δ would come from the same θ_outer)."""

    @property
    def committable(self) -> bool:
        return self.whole and self.same_group

    @staticmethod
    def agree(
        cluster: ClusterComm, report: RoundReport, failed: bool, own_hash: str, galaxy_rank: int
    ) -> RoundView:
        """Gather what each shard's report says into one view (a fixed sequence of collectives on every
        rank)."""
        groups = cluster.gather_strings(",".join(map(str, sorted(report.peers))))
        rejected = _ranks_by_any_rank(cluster, report.rejected)
        stale = _ranks_by_any_rank(cluster, report.stale)
        left_out = galaxy_rank in stale
        in_sync = cluster.all_true(
            not left_out
            and all(
                meta.get("param_hash") == own_hash
                for rank, meta in report.peers.items()
                if rank not in stale or rank == galaxy_rank
            )
        )
        return RoundView(
            whole=cluster.all_true(report.complete and not failed),
            same_group=len(set(groups)) == 1,
            group=frozenset(int(rank) for rank in groups[0].split(",") if rank),
            overtaken=not cluster.all_true(not report.overtaken),  # any shard: a cluster never half-adopts
            rejected=rejected,
            stale=stale,
            in_sync=in_sync,
            left_out=left_out,
        )


def _ranks_by_any_rank(cluster: ClusterComm, ranks: list[int]) -> list[int]:
    """Galaxy ranks some shard's report names, the same list on every rank of the cluster."""
    gathered = cluster.gather_strings(",".join(map(str, ranks)))
    return sorted({int(rank) for ranks in gathered for rank in ranks.split(",") if rank})


@dataclass
class RoundResult:
    """What a round came to for this cluster. The trainer acts on :attr:`diverged`; everything else is for the
    metrics records (:meth:`metrics`, whose keys are a public contract: add, never rename).

    ``outcome``: ``applied`` (this cluster committed the galaxy's average, or its own Δ alone), ``adopted``
    (it took the round's result from a cluster that committed it, its own Δ included: nothing lost),
    ``resynced`` (it took another cluster's state and dropped its own progress since the round started),
    ``sat_out`` (it sent nothing: diverged, out of bound, or behind the galaxy, and kept its own state when no
    state came)."""

    outcome: str
    outer_step: int
    fragment: int
    param_hash: str
    param_checksum: float
    galaxy_alive: int
    attempt: int = 0
    state_source: int | None = None
    """The galaxy rank of the cluster whose state was taken (adopted or re-synced), else ``None``."""
    fragment_hash: str | None = None
    network_wait_seconds: float = 0.0
    galaxy_peers: int = 0
    galaxy_complete: bool = False
    allreduce_seconds: float = 0.0
    matchmaking_seconds: float = 0.0
    exchange_seconds: float = 0.0
    matchmaking_window_seconds: float | None = None
    round_trip_seconds: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    in_sync: bool = False
    pseudo_grad_finite: bool = True
    pseudo_grad_in_bound: bool = True
    pseudo_grad_bound: float | None = None
    pseudo_grad_norm: float | None = None
    average_finite: bool | None = None
    rejected_peers: list[int] = field(default_factory=list)
    compute_utilization: float | None = None
    round_inner_steps: int | None = None
    """``--hv.round-steps by-speed``: the inner steps this cluster took since the synced fragment's last
    sync (what its Δ holds)."""
    round_weight: float | None = None
    """``--hv.round-steps by-speed``: the weight its Δ entered the average with (``round_inner_steps``
    ÷ H)."""
    ledger: LedgerEntry | None = None
    """The ledger entry of the round this cluster's θ_outer now ends at: its own commit (``applied``), the
    committer's (``adopted``), or the last of the chain it took (``resynced``); ``None`` when it holds no
    entry (``sat_out``, or a source that served no chain)."""

    @property
    def diverged(self) -> bool:
        """This cluster's own training blew up this round: its weights came back from the galaxy (or its last
        θ_outer), so the inner optimizer's moments must start afresh."""
        return not (self.pseudo_grad_finite and self.pseudo_grad_in_bound)

    @property
    def committed(self) -> bool:
        """This cluster holds the round's committed result (applied here, or adopted from a committed
        cluster)."""
        return self.outcome in ("applied", "adopted")

    def metrics(self) -> dict[str, Any]:
        record = asdict(self)
        record["ledger"] = self.ledger.to_wire() if self.ledger is not None else None
        record["round_outcome"] = record.pop("outcome")
        record["retries"] = self.attempt
        record["resynced"] = self.outcome == "resynced"
        record["committed"] = self.committed
        for optional in (
            "fragment_hash",
            "average_finite",
            "compute_utilization",
            "round_inner_steps",
            "round_weight",
            "ledger",
            "matchmaking_window_seconds",
            "round_trip_seconds",
        ):
            if record[optional] is None:
                del record[optional]
        return record
