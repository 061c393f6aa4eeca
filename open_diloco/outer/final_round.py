"""Which θ_outer a split galaxy ends on: the rule a cluster applies at the end of its run.

A partition that outlasts the run leaves no later round to heal in: each side trained on and ends with its
own θ_outer. Ending with two models is what no user of a galaxy wants, so every cluster that ends at the same
outer step settles on one by the rule of every heal (``outer/quorum.py``): the chain with the most committed
work, then the one held by the most clusters, then the side holding the lowest galaxy rank (every cluster
computes the same answer from the same records, with no round of its own). Consistency wins over the lighter
side's progress since the split: its rounds are dropped (and recorded so), as a re-sync after a healed
partition drops them. A cluster that stopped early or crashed has no say (it ended elsewhere).

Kept a pure function of the membership view so the rule is read and tested on its own; the waiting and the
download are ``CatchUp.settle_final``'s (``outer/catching_up.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from open_diloco.outer.protocols import Membership


@dataclass(frozen=True)
class FinalVerdict:
    """The galaxy's final θ_outer as this cluster reads the records: whose it is, and how the sides stand."""

    winner_hash: str
    winners: frozenset[int]
    """The clusters ending at this outer step on ``winner_hash``."""
    losers: frozenset[int]
    """The clusters ending at this outer step on another θ_outer."""

    def source_for(self, own_rank: int, view: Membership) -> int | None:
        """The cluster to take the final state from when this one is not among the winners: the lowest
        galaxy rank of those still serving it (``None``: this cluster won, or none serves it any more)."""
        if own_rank in self.winners:
            return None
        serving = sorted(rank for rank in self.winners if rank in view.sources)
        return serving[0] if serving else None


def final_step(view: Membership, own_rank: int, outer_step: int, own_work: int = 0) -> tuple[int, int]:
    """``(committed work, outer step)`` of the state the galaxy ends on: of the chains this cluster and the
    others that finished their run end on, the one with the most committed work (the rule of every heal,
    ``outer/quorum.py``), the furthest step among equals. A cluster can end behind the others' last rounds:
    its inner steps ran ahead of the galaxy's rounds while it held or sat rounds out, so it reached the run's
    last step at an earlier round; it then ends on the state the galaxy went on to."""
    ended = [
        (view.works.get(rank, 0), step)
        for rank, (step, theirs, live) in view.reported.items()
        if rank != own_rank and theirs and not live
    ]
    return max([(own_work, outer_step), *ended])


def final_verdict(
    view: Membership, own_rank: int, outer_step: int, own_hash: str | None, own_work: int = 0
) -> FinalVerdict:
    """Group the clusters whose records end at ``outer_step`` (this one with ``own_hash``; ``None``: this
    one ends before it) by their ``param_hash``; the group whose chain holds the most committed work wins,
    then the larger, then the one with the lowest galaxy rank."""
    sides: dict[str, set[int]] = {own_hash: {own_rank}} if own_hash is not None else {}
    works: dict[str, int] = {own_hash: own_work} if own_hash is not None else {}
    for rank, (step, theirs, _) in view.reported.items():
        if rank != own_rank and step == outer_step and theirs:
            sides.setdefault(theirs, set()).add(rank)
            works[theirs] = max(works.get(theirs, 0), view.works.get(rank, 0))
    winner_hash, winners = max(sides.items(), key=lambda side: (works[side[0]], len(side[1]), -min(side[1])))
    losers = {rank for side_hash, ranks in sides.items() if side_hash != winner_hash for rank in ranks}
    return FinalVerdict(winner_hash, frozenset(winners), frozenset(losers))
