"""θ_outer and the ledger chain that ends at it, changed together (``outer/ledger.py``).

Why one object: a peer downloads this cluster's state on the averager's thread while a round may be committing
on the trainer's. Served apart, a state could carry a chain that does not end at its θ (the entry of a commit
half done), and a joiner would take a history that is not its weights'. Every change of θ_outer that a ledger
entry describes (a commit, an adopted round, a re-sync) goes through here, under one lock that a download
waits for (bounded).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from open_diloco.outer.adoption import Downloaded
from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.deal import Deal, next_deal, to_ranges
from open_diloco.outer.digests import combine_hashes
from open_diloco.outer.goodput import Goodput
from open_diloco.outer.ledger import Dropped, Ledger, LedgerEntry, round_entry
from open_diloco.outer.quorum import next_roster
from open_diloco.outer.state import OuterState

LEDGER_LOCK_SECONDS = 10.0
"""The most a state download waits for a commit in progress to write its ledger entry."""


class CommittedState:
    """This shard's :class:`OuterState` and the cluster's :class:`Ledger`, one lock over both."""

    def __init__(
        self,
        state: OuterState,
        cluster: ClusterComm,
        galaxy_rank: int,
        warn: Callable[[str], Any],
        goodput: Goodput | None = None,
        stride_pages: int | None = None,
    ):
        self.state, self.cluster, self.galaxy_rank, self.warn = state, cluster, galaxy_rank, warn
        self.stride_pages = stride_pages
        """Pages dealt to a cluster per stride (H/P) in an elastic galaxy, whose entries carry the deal
        (``outer/deal.py``); ``None``: a fixed galaxy, no deal."""
        self.ledger = Ledger()
        """The chain of committed rounds this cluster's θ_outer went through."""
        self.goodput = goodput or Goodput(galaxy_rank, tokens_per_step=1, local_steps=1)
        """This cluster's tokens computed and committed: the chain's changes count the committed ones."""
        self.dropped: Dropped | None = None
        """Entries of this cluster's own that the last taken chain replaced, until a round's record says so
        (:meth:`pop_dropped`)."""
        self._lock = threading.Lock()

    def served(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """What a peer downloads (the averager's thread): the shard's outer state and the ledger's tail that
        ends at it. A commit in progress holds the lock from θ_outer's change to its entry; a download waits
        for it (bounded), else it serves no chain rather than one that does not end at its θ."""
        held = self._lock.acquire(timeout=LEDGER_LOCK_SECONDS)
        try:
            metadata, tensors = self.state.snapshot()
            tail = self.ledger.tail() if held else []
        finally:
            if held:
                self._lock.release()
        return {**metadata, "galaxy_rank": self.galaxy_rank, "ledger": tail}, tensors

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Around a change of θ_outer and the ledger together (see :meth:`served`)."""
        with self._lock:
            yield

    @property
    def work(self) -> int:
        """The committed work of the chain that ends at θ_outer (``LedgerEntry.work``): whose state the galaxy
        keeps when chains differ (``outer/quorum.py``)."""
        return self.ledger.work

    def pop_dropped(self) -> dict[str, Any] | None:
        """What the last taken chain dropped of this cluster's own (``ledger_dropped``), once."""
        dropped, self.dropped = self.dropped, None
        return None if dropped is None else dropped.to_wire()

    def cluster_hash(self, shard_hash: str | None = None) -> str:
        """``param_hash`` of the whole cluster's θ_outer (every shard's hash, combined), from this shard's
        ``shard_hash`` (default: its θ_outer now). Collective."""
        return combine_hashes(self.cluster.gather_strings(shard_hash or self.state.hash()))

    def record_commit(
        self,
        attempt: int,
        fragment: int,
        before: str,
        peers: dict[int, dict[str, Any]],
        members: set[int],
        alone: bool,
        fork: bool = False,
        known: Iterable[int] = (),
    ) -> LedgerEntry:
        """The entry of the round just applied (θ_outer is its result), appended to the chain: rank 0's, on
        every rank (its shard's ``peers`` name the members' metadata; every rank holds the same ``before`` and
        ``after``), its roster from the members' (``outer/quorum.py``), and in an elastic galaxy the deal that
        follows (``outer/deal.py``; dealt to the ``known`` clusters less those that left). Called under
        :meth:`changing`."""
        sent = [peers.get(rank, {}) for rank in members]
        # "left" (ended, or silent past --hv.fork-after); an older member sends only "gone"
        gone = {int(rank) for meta in sent for rank in meta.get("left", meta.get("gone")) or ()}
        roster = next_roster((meta.get("roster") for meta in sent), members, gone)
        entry = round_entry(
            round_no=self.state.outer_step,
            attempt=attempt,
            fragment=fragment,
            before=before,
            after=self.cluster_hash(),
            peers=peers,
            members=members,
            alone=alone,
            roster=roster,
            fork=fork,
        )
        if self.stride_pages is not None:
            entry = self._with_deal(entry, peers, members, set(known) - gone)
        (wire,) = self.cluster.broadcast_strings([json.dumps(entry.to_wire())])
        entry = LedgerEntry.from_wire(json.loads(wire))
        if broken := self.ledger.append(entry):
            self.warn(broken)
        self.goodput.appended(entry)
        return entry

    def _with_deal(
        self, entry: LedgerEntry, peers: dict[int, dict[str, Any]], members: set[int], dealt_to: set[int]
    ) -> LedgerEntry:
        """``entry`` with the deal after it and the pages it committed (``outer/deal.py``): from the chain's
        last deal and what each member said its Δ carries."""
        last = self.ledger.last
        parent = (last.dealt if last is not None else None) or Deal()
        carries = {
            rank: {
                int(stride): (int(lo), int(hi)) for stride, (lo, hi) in (meta.get("carries") or {}).items()
            }
            for rank in members
            if isinstance(meta := peers.get(rank, {}), dict)
        }
        settled = next_deal(
            parent, entry.round, carries, dealt_to, self.stride_pages or 1, self.state.fragments
        )
        pages = {str(rank): to_ranges(kept) for rank, kept in sorted(settled.committed.items())}
        return replace(entry, deal=settled.deal.to_wire(), pages=pages)

    def take(self, got: Downloaded, own_round: bool = False) -> None:
        """θ_outer and the chain that ends at it, from one download, together: ``own_round``: the round this
        cluster sent its Δ to, taken as its own commit (:meth:`OuterState.adopt_round`), else a re-sync onto
        the source's trajectory."""
        with self.changing():
            if own_round:
                self.state.adopt_round(got.metadata, got.tensors)
            else:
                self.state.adopt(got.metadata, got.tensors)
            before = list(self.ledger.entries)
            dropped = self.ledger.take(got.metadata.get("ledger"))
            self.goodput.chain_changed(before, self.ledger.entries)
        if dropped is not None:
            self.dropped = dropped
            self.warn(
                f"ledger: this cluster's rounds {dropped.rounds[0]}..{dropped.rounds[1]} (committed work "
                f"{dropped.work}, head {dropped.head}) are dropped for cluster {got.source}'s chain (work "
                f"{dropped.kept_work}, head {dropped.kept_head}): the galaxy keeps the chain with more "
                "committed work"
            )

    def held_entry(self) -> LedgerEntry | None:
        """The ledger entry of the θ_outer this cluster holds now (``None``: its chain does not reach it, e.g.
        a source of an older version served none)."""
        last = self.ledger.last
        return last if last is not None and last.round == self.state.outer_step else None
