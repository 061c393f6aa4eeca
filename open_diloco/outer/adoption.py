"""Taking the galaxy's outer state from one cluster (in parts from every cluster that holds the same state):
the one path for joining, re-syncing and adopting a round that another cluster committed.

Why one source: each rank of a cluster downloads its own shard. Left to hivemind, each rank takes whichever
peer its DHT lists first, so after two clusters ended up with different θ at the same step a cluster could
assemble a θ that no cluster holds. Here rank 0 picks one source cluster from the membership records and every
rank downloads its shard from *that* cluster's averager of the same shard (striped over the other clusters
whose records show the same outer step and ``param_hash``: rank 0's list too), checks the bytes against the
hash the source sent with them, and the ranks agree that all of them got the same step before anyone takes it.
Every branch runs the same collectives on every rank, so a rank whose download fails can never leave its
siblings in a collective it skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.digests import combine_hashes, fingerprint_bytes
from open_diloco.outer.protocols import Averager, Membership

RETRY_SECONDS = 0.5
"""Pause between two tries of a download (a source still applying the round, a record not yet propagated)."""


@dataclass(frozen=True)
class Downloaded:
    """A state every rank of the cluster holds, from one source cluster, at one outer step."""

    source: int
    """The galaxy rank of the cluster it came from."""
    step: int
    metadata: dict[str, Any]
    tensors: list[torch.Tensor]


def choose_source(
    view: Membership,
    own_rank: int,
    at_least: int,
    exact: int | None = None,
    only: frozenset[int] | None = None,
    min_work: int = 0,
    failed: dict[int, int] | None = None,
) -> tuple[int, int] | None:
    """``(galaxy rank, outer step)`` of the live cluster to take the state from: at outer step ``at_least`` or
    later, its chain holding at least ``min_work`` (this cluster's own: a state with less committed work is a
    fork the galaxy does not keep, never taken), ``exact`` first when given (a round this cluster sent its Δ
    to), else the one ahead of all (the most committed work, then the furthest step); ties go to the lowest
    galaxy rank, so clusters that re-sync at once pick the same source; among ``only`` when given; a cluster
    that finished its run only at ``exact``, or once no other cluster trains on (:func:`_galaxy_finished`).
    ``failed``: downloads that already failed from a cluster, by galaxy rank: another cluster whose record
    shows the very same state (step, committed work and ``param_hash``) goes first. Why: a source killed
    right after its round stays in the records until ``--hv.member-expiry``, and the lowest rank won every
    try: two clusters of the `intercontinental` soak (2026-12-03) sat out 60 s dialling a dead cluster 0
    while cluster 1 served the same round. Never another state: equal work and step with another hash is a
    fork, and the rule of which fork is kept must not depend on who could dial whom.
    ``None``: no live cluster qualifies (or none whose record names this shard's averager)."""
    finished = _galaxy_finished(view, own_rank)
    candidates = [
        (rank, step, view.works.get(rank, 0))
        for rank, step in view.steps.items()
        if rank != own_rank
        and step >= at_least
        and view.works.get(rank, 0) >= min_work
        and rank in view.sources
        and (only is None or rank in only)
        and (_still_training(view, rank) or step == exact or finished)
    ]
    if not candidates:
        return None
    best = min(candidates, key=lambda item: (item[1] != exact, -item[2], -item[1], item[0]))
    if failed and failed.get(best[0]):
        state = view.report_of(best[0])[1]
        same = [c for c in candidates if c[1:] == best[1:] and state and view.report_of(c[0])[1] == state]
        best = min(same or [best], key=lambda item: (failed.get(item[0], 0), item[0]))
    return best[0], best[1]


def choose_holders(
    view: Membership, own_rank: int, source: int, only: frozenset[int] | None = None
) -> list[int]:
    """The other live clusters that hold ``source``'s state, by galaxy rank: at its outer step with its
    ``param_hash`` (the whole model's, so every shard is the same), serving this shard; among ``only`` when
    given. Empty when ``source``'s record names no hash (nothing to compare with). Each is checked again
    when the download pins its state (``galaxy/striped_download.py``): a record may be a round behind."""
    step, param_hash, _ = view.reported.get(source, (view.steps.get(source, -1), None, True))
    if param_hash is None:
        return []
    return sorted(
        rank
        for rank, (their_step, their_hash, live) in view.reported.items()
        if rank not in (own_rank, source)
        and live
        and rank in view.sources
        and their_step == step == view.steps.get(rank)
        and their_hash == param_hash
        and (only is None or rank in only)
    )


def _still_training(view: Membership, rank: int) -> bool:
    """A cluster that finished its run serves its final state only to a cluster at exactly that round (its
    last average came short). Why not as the galaxy's state for a cluster behind it: a side cut off by a
    partition trains on alone at full speed and finishes first; taking its final state would hand the galaxy
    to the smaller side (seen in a targeted soak, docs/results/chaos-soak.md). Without a record (the
    in-process galaxy of unit tests) a source counts as training."""
    return view.report_of(rank)[2]


def _galaxy_finished(view: Membership, own_rank: int) -> bool:
    """No other cluster with a record trains on: the galaxy finished its run while this cluster was apart (a
    cut across the run's end, chaos soak `lan` seed 3). Its final state, the heaviest chain (``min_work``),
    is then the galaxy's, and this cluster ends on it (the trainer's clock jumps to the run's end) rather than
    train its last rounds alone and end split. Not while any other cluster still trains: a side that trained
    alone and finished first must not hand the galaxy to itself (:func:`_still_training`)."""
    others = [live for rank, (_, _, live) in view.reported.items() if rank != own_rank]
    return bool(others) and not any(others)


def served_hash(metadata: dict[str, Any], tensors: list[torch.Tensor]) -> str:
    """The hash of a downloaded state as its server computed it (``OuterState.hash``: θ_outer, then the sparse
    block scores when it sent them)."""
    shared = [tensors[0]] + ([tensors[-1].reshape(-1)] if metadata.get("sparse_scores") else [])
    return fingerprint_bytes(*shared)


class StateAdoption:
    """Downloads of one cluster's shards, agreed by its ranks (see the module docstring)."""

    def __init__(
        self,
        averager: Averager,
        cluster: ClusterComm,
        galaxy_rank: int,
        warn: Callable[[str], Any],
        own_work: Callable[[], int] = lambda: 0,
    ):
        self.averager, self.cluster, self.galaxy_rank, self.warn = averager, cluster, galaxy_rank, warn
        self.own_work = own_work
        """The committed work of this cluster's chain now: no download takes a chain with less."""

    def download(
        self,
        at_least: int,
        timeout: float,
        exact: int | None = None,
        appear_within: float | None = None,
        only: frozenset[int] | None = None,
    ) -> Downloaded | None:
        """Every rank's shard of one source cluster's state at outer step ``at_least`` or later (``exact``
        first; from a cluster in ``only`` when given), tried until ``timeout``; ``None`` on every rank when it
        did not come whole and agreed in time.
        ``appear_within``: give up
        sooner when no record has shown a source at all after that many seconds (nobody has that state)."""
        started = time.monotonic()
        deadline = started + timeout
        failed: dict[int, int] = {}  # rank 0's: its choice is every rank's
        while True:
            view = self.averager.membership()
            pick = choose_source(view, self.galaxy_rank, at_least, exact, only, self.own_work(), failed)
            ranks = [] if pick is None else [pick[0], *choose_holders(view, self.galaxy_rank, pick[0], only)]
            chosen = self.cluster.gather_strings(",".join(map(str, ranks)))[0]  # rank 0's source and holders
            if (
                appear_within is not None
                and not chosen
                and self.cluster.all_true(time.monotonic() - started > appear_within)
            ):
                return None
            ranks = [int(rank) for rank in chosen.split(",")] if chosen else []
            got = self._fetch(ranks[0], view, ranks[1:], deadline) if ranks else None
            step = -1 if got is None else int(got[0].get("outer_step", -1))
            whole = self.cluster.all_true(got is not None and step >= at_least)
            agreed = whole and self.cluster.min_int(step) == -self.cluster.min_int(-step)
            if agreed and self._is_its_entrys(ranks[0], *got):
                return Downloaded(ranks[0], step, *got)
            if ranks:
                failed[ranks[0]] = failed.get(ranks[0], 0) + 1
            if not self.cluster.all_true(time.monotonic() + RETRY_SECONDS < deadline):
                return None
            time.sleep(RETRY_SECONDS)

    def _is_its_entrys(self, source: int, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> bool:
        """The θ every rank downloaded, combined, is the one the source's ledger entry for that round says
        it committed (the entry's ``after``): the state is taken by the galaxy's record of it, not only by
        step and per-shard hashes. Every rank answers the same (rank 0's entry, every rank's shard). True when
        the source served no entry for its step (an older version)."""
        tail = metadata.get("ledger") or []
        last = tail[-1] if tail else {}
        expected = str(last.get("after", "")) if last.get("round") == metadata.get("outer_step") else ""
        combined = combine_hashes(self.cluster.gather_strings(served_hash(metadata, tensors)))
        expected = self.cluster.gather_strings(expected)[0]
        if not expected or combined == expected:
            return True
        self.warn(
            f"the state downloaded from cluster {source} (θ {combined}) is not the one its ledger entry for "
            f"outer step {metadata.get('outer_step')} committed ({expected}): trying again"
        )
        return False

    def _fetch(
        self, source: int, view: Membership, holders: list[int], deadline: float
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """This rank's shard of ``source``'s state (from that cluster's averager of this shard, and in parts
        from the ``holders``' too: the same state), its bytes checked against the hash the source sent with
        them."""
        left, peer = deadline - time.monotonic(), view.sources.get(source)
        if peer is None or left <= 0:
            return None
        others = [view.sources[rank] for rank in holders if rank in view.sources]
        got = self.averager.download_state(left, source=peer, holders=others)
        if got is None:
            return None
        metadata, tensors = got
        if "shard_hash" in metadata and served_hash(metadata, tensors) != metadata["shard_hash"]:
            self.warn(
                f"a state download from cluster {source} does not match the hash it came with: trying again"
            )
            return None
        return metadata, tensors
