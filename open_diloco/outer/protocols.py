"""What the outer loop needs from a galaxy (:class:`Averager`, :class:`Membership`, :class:`RoundReport`) and
where it tells its status (:class:`StatusBoard`). The galaxy package implements them over hivemind; tests
in-process. What the trainer needs from the outer loop is ``outer/loop.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from open_diloco.outer.matchmaking import MatchmakingPlan


@dataclass
class RoundReport:
    """What one all-reduce of one shard did.

    ``peers`` maps each participating cluster's galaxy rank to the metadata it sent with the round (its
    fingerprint: the hash of its θ_outer shard before the round, its round id), so every cluster can check
    that it and every other cluster started the round from the same weights.
    """

    group_size: int
    """Clusters whose pseudo-gradient went into the average (this one included)."""
    complete: bool
    """True when every span of the buffer was averaged over the whole group (no failed reducer)."""
    peers: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    """From the round's start until the trainer took its result (with ``--hv.sync-delay``, when it landed)."""
    matchmaking_seconds: float = 0.0
    """From the round's start until its group formed (0 for a galaxy of one)."""
    exchange_seconds: float = 0.0
    """From the group's forming until the average was written: the all-reduce on the wire."""
    matchmaking_window_seconds: float | None = None
    """How long the round's first peer would wait for a late live cluster (``outer/matchmaking.py``)."""
    matchmaking_min_group: int | None = None
    """The fewest clusters the round's group could close with (``quorum.smallest_group``): a majority of the
    roster while more than half of it is alive, else 2."""
    round_trip_seconds: float | None = None
    """The 90th percentile round trip this shard measured to the other clusters (``None``: none yet)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected: list[int] = field(default_factory=list)
    """Galaxy ranks whose parts this shard's reducer left out of the average as not finite."""
    stale: list[int] = field(default_factory=list)
    """Galaxy ranks outside the round's cohort (``policy.out_of_cohort``: they started from another round or
    θ_outer), left out by every reducer; they re-sync."""
    moved_on: bool = False
    """While this peer looked for a group, every other live cluster it could meet started a later attempt of
    the round: nobody is left in this one. The round is not whole; the next attempt joins theirs."""
    overtaken: bool = False
    """While this peer still looked for a group, the galaxy applied this very round without it (the membership
    records show a later outer step): a retry after a part was lost on its way, say. Nobody is left to average
    with; the cluster adopts the galaxy's state at once rather than wait for the galaxy's next round."""

    def record_fields(self) -> dict[str, Any]:
        """What the round's metrics record says of this all-reduce (``RoundResult``'s fields)."""
        return dict(
            galaxy_peers=self.group_size,
            allreduce_seconds=self.seconds,
            matchmaking_seconds=self.matchmaking_seconds,
            exchange_seconds=self.exchange_seconds,
            matchmaking_window_seconds=self.matchmaking_window_seconds,
            matchmaking_min_group=self.matchmaking_min_group,
            round_trip_seconds=self.round_trip_seconds,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )


MEMBERSHIP_READ_SECONDS = 3.0
"""The most one read of the membership records may take (``Averager.membership`` is bounded so): what a read
adds to a round's start, and what a wait for a record to show up allows per read."""


@dataclass(frozen=True)
class Membership:
    """The galaxy as its clusters' membership records describe it when a round starts."""

    departed: frozenset[int] = frozenset()
    """Galaxy ranks that left (end of run, a stop) or have not refreshed their record for
    --hv.member-expiry."""
    lead: int = -1
    """The outer step of the live cluster ahead of all: the one whose chain holds the most committed work, the
    furthest step among equals (-1: unknown). A cluster behind it would send a Δ taken from a θ_outer the
    galaxy left behind."""
    lead_work: int = 0
    """The committed work of that cluster's chain (``LedgerEntry.work``)."""
    silent: frozenset[int] = frozenset()
    """The departed ranks that did not say they ended: crashed, or cut off and perhaps training on (a
    partition). A cluster whose round met nobody cannot call itself in sync while any is silent."""
    silent_seconds: dict[int, float] = field(default_factory=dict)
    """How long each :attr:`silent` cluster has been silent (its record's age on this reader's clock): a cut
    is back within minutes, a crash never is (``CatchUp.settle_final`` waits only for the recent)."""
    lead_inner_step: int = -1
    """The furthest inner step a live cluster at the ``lead`` outer step has reported (-1: unknown): how far
    into the next round the galaxy is, for a cluster that just adopted the lead state
    (``CatchUp._catch_up_target``)."""
    lead_seen_seconds: float = 0.0
    """How long ago that cluster reported ``lead_inner_step`` (its record's age): it has trained on since."""
    steps: dict[int, int] = field(default_factory=dict)
    """The outer step each cluster that can serve a round's state shows, by galaxy rank: the live ones and
    those that finished their run moments ago (a finished cluster serves its final state while it drains)."""
    works: dict[int, int] = field(default_factory=dict)
    """The committed work of the chain each cluster with a record holds (0: not said), by galaxy rank: a state
    is taken only from a chain with at least this cluster's work (``outer/adoption.py``)."""
    sources: dict[int, str] = field(default_factory=dict)
    """The PeerID of this shard's averager in each cluster of :attr:`steps`: where to download it from."""
    attempts: dict[int, tuple[int, int]] = field(default_factory=dict)
    """``(round, attempt)`` each live cluster last started, by galaxy rank: a cluster starting a round joins
    the galaxy's current attempt of it, and one looking for a group in an attempt the others left moves on."""

    step_seconds: dict[int, float] = field(default_factory=dict)
    """Seconds per inner step each live cluster published (``--hv.round-steps by-speed``), by galaxy rank:
    the fastest sets how many steps the slower ones take per stride (``outer/pacing.py``)."""

    reported: dict[int, tuple[int, str | None, bool]] = field(default_factory=dict)
    """``(outer step, param_hash, still training)`` of every cluster with a record, ended ones too, by galaxy
    rank: what a cluster at the end of its run compares its final θ_outer with."""

    ages: dict[int, float] = field(default_factory=dict)
    """How long ago each cluster with a record refreshed it (its age on this reader's clock,
    ``galaxy/record_ages.py``), by galaxy rank: a holding cluster learns from it that the others are back
    (``outer/hold_pause.py``)."""

    def report_of(self, rank: int) -> tuple[int, str | None, bool]:
        """``reported[rank]``; a cluster without a record reads as still training, at no step and with no
        hash (the in-process galaxy of unit tests publishes none)."""
        return self.reported.get(rank, (-1, None, True))

    def behind(self, round_no: int, galaxy_rank: int) -> frozenset[int]:
        """Other live clusters whose last started round is before ``round_no``: on their way to it (finishing
        their stride, or taking the last round's result), not gone."""
        return frozenset(
            rank for rank, (rnd, _) in self.attempts.items() if rank != galaxy_rank and rnd < round_no
        )

    def attempt_of(self, round_no: int) -> int:
        """The latest attempt of round ``round_no`` a live cluster started (0 when none did)."""
        return max((attempt for rnd, attempt in self.attempts.values() if rnd == round_no), default=0)


class AloneRound:
    """The round of a cluster that knows it is the only one alive: its own Δ is the average, at once (no
    matchmaking that could only wait for the timeout)."""

    def __init__(self, galaxy_rank: int, metadata: dict[str, Any]):
        self.galaxy_rank, self.metadata = galaxy_rank, metadata

    def wait(self) -> RoundReport:
        return RoundReport(group_size=1, complete=True, peers={self.galaxy_rank: self.metadata})


class PendingRound(Protocol):
    """An all-reduce in flight. The trainer may keep computing until it calls :meth:`wait`."""

    def wait(self) -> RoundReport:
        """Block until the round ends (bounded by the averager's timeout); raise ``RoundFailed`` if it
        produced no result. On success the averager's buffer holds the galaxy average."""
        ...


class Averager(Protocol):
    """Averages one FSDP shard's flat fp32 pseudo-gradient with the same shard of every other cluster.

    The averager owns the buffer that goes on the wire, so the outer loop computes Δ straight into it (no
    extra copy of the shard). Promise: every participant of a round ends with *bitwise-identical* contents
    (a canonical result, not ``own + (avg - own)``), also under compression.
    """

    def buffer(self) -> contextlib.AbstractContextManager[torch.Tensor]:
        """The flat fp32 CPU buffer the next round averages in place, locked for the caller: a round that
        outlived its timeout may still be writing, and the lock waits for it (bounded; ``RoundFailed``)."""
        ...

    def matchmaking_plan(self, live_clusters: int, coming: bool = False) -> MatchmakingPlan:
        """How the next round's matchmaking waits for ``live_clusters`` clusters (``outer/matchmaking.py``);
        ``coming``: a live cluster is still on its way from an earlier round."""
        ...

    def start_round(
        self,
        round_id: int,
        fingerprint: dict[str, Any],
        attempt: int = 0,
        plan: MatchmakingPlan | None = None,
    ) -> PendingRound:
        """Begin attempt ``attempt`` of averaging the buffer's current contents for the round that starts from
        outer step ``round_id``; ``fingerprint`` travels to every peer. Peers of other rounds or attempts
        never meet it. ``plan``: its matchmaking, agreed by the cluster's ranks (default: this shard's own,
        for the whole galaxy)."""
        ...

    def membership(self) -> Membership:
        """What the clusters' membership records say now (see :class:`Membership`); the empty default when
        nothing is known (no record read in time): a round then waits for the whole galaxy, as without
        them."""
        ...

    def genesis_entry(self) -> dict[str, Any] | None:
        """The ledger entry of this run's first round as the DHT mirrors it (``galaxy/ledger_mirror.py``),
        ``None`` when none is there: an elastic cluster with no chain of its own asks it before a first
        round of its own, which would start a second history under the same run id."""
        ...

    def serve_state(self, get_state: Any) -> None:
        """Let late joiners download the outer state: ``get_state()`` returns ``(metadata, tensors)``."""
        ...

    def download_state(
        self, timeout: float, source: str | None = None, holders: Sequence[str] | None = None
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """Fetch ``(metadata, tensors)`` from ``source`` (a ``Membership.sources`` value), or any peer serving
        this shard; ``None`` when none answers in time. ``holders`` (a list, even empty): other sources that
        hold the same state (the same outer step and ``param_hash``): the state comes in checked parts from
        all of them, ``source`` saying which state is wanted."""
        ...

    def shutdown(self, finished: bool = False) -> None:
        """Stop the averager and its DHT; idempotent; bounded in time; leaves no process behind. ``finished``:
        the run ended (rather than was stopped), so it may wait a little longer for the peers of its last
        round."""
        ...


class StatusBoard(Protocol):
    """Where a cluster tells the rest of the galaxy (and its operators) how it is doing:
    ``open-diloco status`` reads it. The galaxy package keeps it in the DHT; only a cluster's rank 0 has a
    real one."""

    def update(self, step_record: dict[str, Any]) -> None:
        """Take an inner step's metrics record (or ``{"state": ...}``); publishes in the background."""
        ...

    def close(self) -> None:
        """Publish the last record (bounded in time) and stop publishing."""
        ...


class NullStatusBoard:
    """Ranks other than 0, and tests: nothing to tell."""

    def update(self, step_record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
