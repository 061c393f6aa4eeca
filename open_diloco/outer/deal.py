"""The deal: which pages of the training order each cluster of an elastic galaxy trains, fixed by the ledger.

Why the ledger deals: in a fixed galaxy cluster k of N reads every N-th sample of the order, a split made once
at launch. When clusters come and go that split has no N to use, and whatever a cluster trained in a
contribution that was not committed (left out, held, re-synced, sat out, gone) would never reach θ_outer. Here
the training order is cut into **pages** (one inner step of one cluster: ``--total-batch-size`` samples, the
same in every cluster) and every ledger entry carries a :class:`Deal`: the next fresh page (``cursor``), the
pages that came back (``queue``, dealt before fresh ones) and the hands of the strides in progress. Every
member of a round computes the next deal from the same inputs (the parent entry's deal and the round's
gathered metadata), so the galaxy agrees on it with no coordinator and no message of its own.

The rules, with T = H/P inner steps a stride (``--hv.local-steps`` / ``--hv.fragments``):

* **Dealt ahead**: the entry of round r deals stride r + 2 (:data:`LOOKAHEAD`): T pages to every cluster the
  round's members know (the roster and every cluster with a record), less those that left. With a sync in
  flight for up to T inner steps (``--hv.sync-delay``), stride r + 1 trains while round r runs, so the deal a
  stride reads is always known before it starts. A stride without a hand (the galaxy's first two, a joiner's
  first) is not trained: its steps pass (its Δ then carries no page and weighs as one: see ``own_pages``).
* **Carried**: a cluster says in each round's metadata which of its pages its Δ holds (``carries``: per
  stride, the range of its hand trained since its θ_local last went back to θ_outer: a held round, a re-sync,
  a sit-out). With P fragments a page trained in stride k is in the Δ of rounds k … k + P − 1 (each fragment's
  next sync).
* **Committed**: a page of stride k dealt to cluster c is committed when the entries of rounds k … k + P − 1
  (one chain) all name c a member and c said in each that it carries the page. It is settled by the entry of
  round k + P − 1; a page some covering round did not carry goes back to the queue at once (it will never be
  committed from that hand), and so do the pages of a cluster that left before training its hand.

Pure Python: no torch, no hivemind (``open-diloco audit-data`` and ``status`` read deals from records).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

LOOKAHEAD = 2
"""The entry of round r deals stride r + LOOKAHEAD."""


@dataclass(frozen=True)
class Hand:
    """The pages one cluster was dealt for one stride, and the part of them still carried by every round that
    covered the stride so far (``lo`` … ``hi``, indices into ``pages``; the pages outside went back)."""

    pages: tuple[int, ...]
    lo: int = 0
    hi: int | None = None
    """``None``: no round covered the stride yet (everything still possible)."""

    @property
    def kept(self) -> tuple[int, ...]:
        return self.pages[self.lo : len(self.pages) if self.hi is None else self.hi]

    def carried_by(self, carried: tuple[int, int] | None) -> Hand:
        """This hand after one more covering round that carried ``carried`` of it (``None``: none of it)."""
        lo, hi = carried if carried is not None else (0, 0)
        new_lo, new_hi = max(self.lo, lo), min(len(self.pages) if self.hi is None else self.hi, hi)
        return Hand(self.pages, new_lo, max(new_lo, new_hi))

    def to_wire(self) -> list[Any]:
        return [to_ranges(self.pages), self.lo, self.hi]

    @staticmethod
    def from_wire(fields: list[Any]) -> Hand:
        pages, lo, hi = fields
        return Hand(tuple(from_ranges(pages)), int(lo), None if hi is None else int(hi))


@dataclass(frozen=True)
class Deal:
    """The deal after one entry: what every member of the next round starts from."""

    cursor: int = 0
    """The first page never dealt."""
    queue: tuple[int, ...] = ()
    """Pages that came back, lowest first: dealt before fresh ones."""
    hands: Mapping[int, Mapping[int, Hand]] = field(default_factory=dict)
    """Stride → galaxy rank → its hand, for every stride dealt and not yet settled."""
    committed: int = 0
    """Pages the chain committed so far (every entry's, to this one)."""

    def hand(self, stride: int, rank: int) -> Hand | None:
        return self.hands.get(stride, {}).get(rank)

    @property
    def in_flight(self) -> set[int]:
        """Pages dealt and not yet settled, and the queue: what the ledger holds beside the committed."""
        return set(self.queue) | {
            page for hands in self.hands.values() for h in hands.values() for page in h.kept
        }

    def to_wire(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "queue": to_ranges(self.queue),
            "hands": {
                str(stride): {str(rank): hand.to_wire() for rank, hand in sorted(hands.items())}
                for stride, hands in sorted(self.hands.items())
            },
            "committed": self.committed,
        }

    @staticmethod
    def from_wire(fields: dict[str, Any]) -> Deal:
        return Deal(
            cursor=int(fields["cursor"]),
            queue=tuple(from_ranges(fields["queue"])),
            hands={
                int(stride): {int(rank): Hand.from_wire(hand) for rank, hand in hands.items()}
                for stride, hands in fields["hands"].items()
            },
            committed=int(fields.get("committed", 0)),
        )


@dataclass(frozen=True)
class Settled:
    """What one round did to the deal: the next deal, and the pages it committed (by cluster) and returned."""

    deal: Deal
    committed: dict[int, tuple[int, ...]]
    returned: tuple[int, ...]


def next_deal(
    deal: Deal,
    round_no: int,
    carries: Mapping[int, Mapping[int, tuple[int, int]]],
    dealt_to: Iterable[int],
    stride_pages: int,
    fragments: int,
) -> Settled:
    """The deal after round ``round_no`` committed with the members in ``carries`` (rank → stride → the range
    of its hand its Δ carries), dealing stride ``round_no + LOOKAHEAD`` to ``dealt_to`` (``stride_pages``
    each). See the module doc for the rules."""
    returned: list[int] = []
    committed: dict[int, tuple[int, ...]] = {}
    dealt_to = sorted(set(dealt_to))
    hands: dict[int, dict[int, Hand]] = {}
    for stride, stride_hands in sorted(deal.hands.items()):
        if stride < round_no - fragments + 1:  # settled by an entry this chain lacks: nothing to carry it
            returned.extend(page for hand in stride_hands.values() for page in hand.kept)
            continue
        kept: dict[int, Hand] = {}
        for rank, hand in sorted(stride_hands.items()):
            if stride > round_no:  # dealt, not trained yet: back only when its cluster left
                if rank in dealt_to or rank in carries:
                    kept[rank] = hand
                else:
                    returned.extend(hand.kept)
                continue
            after = hand.carried_by(carries.get(rank, {}).get(stride) if rank in carries else None)
            still = set(after.kept)
            returned.extend(page for page in hand.kept if page not in still)
            if stride == round_no - fragments + 1:  # its last covering round: settled
                if after.kept:
                    committed[rank] = committed.get(rank, ()) + after.kept
            else:
                kept[rank] = after
        if kept:
            hands[stride] = kept
    queue = sorted(set(deal.queue) | set(returned))
    cursor = deal.cursor
    target = round_no + LOOKAHEAD
    new_hands: dict[int, Hand] = dict(hands.get(target, {}))  # (none: an entry deals each stride once)
    for rank in (rank for rank in dealt_to if rank not in new_hands):
        take, queue = queue[:stride_pages], queue[stride_pages:]
        fresh = stride_pages - len(take)
        new_hands[rank] = Hand(tuple(take) + tuple(range(cursor, cursor + fresh)))
        cursor += fresh
    if new_hands:
        hands[target] = new_hands
    total = deal.committed + sum(len(pages) for pages in committed.values())
    return Settled(Deal(cursor, tuple(queue), hands, total), committed, tuple(sorted(returned)))


def to_ranges(pages: Iterable[int]) -> list[list[int]]:
    """Pages as ``[first, last + 1]`` runs, in their order (a hand's order is its training order)."""
    runs: list[list[int]] = []
    for page in pages:
        if runs and runs[-1][1] == page:
            runs[-1][1] += 1
        else:
            runs.append([page, page + 1])
    return runs


def from_ranges(runs: Iterable[Iterable[int]]) -> list[int]:
    return [page for first, stop in runs for page in range(int(first), int(stop))]
