"""What a round came to for one cluster (:class:`RoundResult`): the one object the trainer acts on and the
metrics records are made from (their keys are a public contract: add, never rename)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from open_diloco.outer.ledger import LedgerEntry


@dataclass
class RoundResult:
    """What a round came to for this cluster. The trainer acts on :attr:`diverged`; everything else is for the
    metrics records (:meth:`metrics`, whose keys are a public contract: add, never rename).

    ``outcome``: ``applied`` (this cluster committed the galaxy's average, or its own Δ alone), ``adopted``
    (it took the round's result from a cluster that committed it, its own Δ included: nothing lost),
    ``resynced`` (it took another cluster's state and dropped its own progress since the round started),
    ``sat_out`` (it sent nothing: diverged, out of bound, or behind the galaxy, and kept its own state when no
    state came), ``held`` (no majority of the galaxy's roster: nothing committed, the stride dropped;
    ``outer/quorum.py``)."""

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
    matchmaking_min_group: int | None = None
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
    sync_step: int | None = None
    """The inner step (the galaxy's, with steps by speed) the sync started after: its Δ holds this cluster's
    training up to that step, and what it trained after it goes into the fragment's next sync (a delayed
    sync lands later, at the record's ``step``). Read by ``open-diloco audit-data``."""
    committed_work: int = 0
    """The committed work (tokens) of the ledger chain that ends at this cluster's θ_outer now
    (``LedgerEntry.work``): how the galaxy tells which of two forks to keep."""
    ledger_dropped: dict[str, Any] | None = None
    data_cursor: int | None = None
    """An elastic galaxy: the first page the chain's deal never dealt (``outer/deal.py``)."""
    data_committed_pages: int | None = None
    """An elastic galaxy: the pages the chain committed so far."""
    pages: list[list[int]] | None = None
    """An elastic galaxy: the pages of this cluster's that the round's entry committed (``[first, last + 1]``
    runs; ``outer/deal.py``), ``[]`` when none; ``None`` in a fixed galaxy or without an entry."""
    """This cluster's own entries that the chain it took replaced (``ledger.Dropped``): a fork not kept."""
    goodput: dict[str, Any] | None = None
    """``tokens_computed``, ``tokens_committed`` and ``goodput`` of this cluster after the round
    (``outer/goodput.py``); in the record as top-level keys."""
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

    @property
    def dropped_progress(self) -> bool:
        """The round sent θ_local back to θ_outer (every fragment: held, re-synced, sat out): nothing trained
        before it is behind the next Δ (its steps, ``Pace.dropped``; its pages, ``OwnPages.reset``)."""
        return self.outcome in ("held", "sat_out", "resynced")

    def metrics(self) -> dict[str, Any]:
        record = asdict(self)
        record["ledger"] = self.ledger.to_wire() if self.ledger is not None else None
        record["round_outcome"] = record.pop("outcome")
        record["retries"] = self.attempt
        record["resynced"] = self.outcome == "resynced"
        record["committed"] = self.committed
        record.update(record.pop("goodput") or {})
        if self.ledger is not None and self.ledger.roster is not None:
            # whose majority the next round needs (status shows it)
            record["roster"] = list(self.ledger.roster)
        for optional in (
            "fragment_hash",
            "average_finite",
            "compute_utilization",
            "round_inner_steps",
            "round_weight",
            "sync_step",
            "ledger",
            "ledger_dropped",
            "pages",
            "data_cursor",
            "data_committed_pages",
            "matchmaking_window_seconds",
            "matchmaking_min_group",
            "round_trip_seconds",
        ):
            if record[optional] is None:
                del record[optional]
        return record
