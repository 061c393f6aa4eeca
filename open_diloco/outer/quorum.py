"""Which side of a split galaxy may commit a round: the one that holds a majority of the roster.

Why: before this rule, after a partition the side that ran ahead won, whatever its size. A cluster cut off for
30 s committed rounds alone (they cost it nothing), came back 15–30 outer steps ahead, and the three healthy
clusters re-synced onto it: their work during the cut, thrown away (docs/results/chaos-soak.md). Both sides of
a partition hold the same chain up to the cut, so they agree on its roster without a message, and at most one
side can hold more than half of it.

- **The roster** is carried by the ledger (``LedgerEntry.roster``): a committed round's roster is the rosters
  its members held, and its members, less the clusters a member saw leave for good (a record that says it
  ended, or silent past ``--hv.fork-after``: not past ``--hv.member-expiry``, which a cut is too; see
  ``round._membership``). It changes only by a committed entry, so only a side with a quorum changes it; a
  cluster that comes back joins it again with the first round it is a member of. Before the
  first entry (or from entries older than the roster) it is every rank of ``--hv.galaxy-size``.
- **A quorum**: the round's members hold more than half of the roster's clusters that have not said they
  ended, or exactly half when they hold its lowest rank (the tie-break: one side of an even split, the same
  on both sides).
- **Without one** a cluster *holds*: it commits nothing, drops the round's stride (its fragment lands on the
  unchanged θ_outer, so its next Δ stays one stride's and within the guard's bound), trains that stride
  again (its clock goes back: ``CatchUp.clock_after``) once news comes that it could commit
  (``outer/hold_pause.py``), and takes the majority's state when the partition heals (it is behind by then).
- **A fork**, where no majority can be had (the majority is gone for good, or an even split's other side):
  after ``--hv.fork-after`` seconds of holding, the cluster commits on an entry marked ``fork``; its
  roster is then its own side.
- **Groups no smaller than a majority** while more than half of the roster is alive
  (:func:`smallest_group`): a pair in a galaxy of four alive can only hold, so matchmaking keeps looking
  rather than close it; a side of a real split closes its pair once the others' records have expired.
- **The heal**: wherever two clusters hold different states, the galaxy keeps the one whose chain holds more
  committed work (``LedgerEntry.work``: tokens committed, cumulative), never the one further in rounds; the
  other's clusters take it and record the rounds they drop (``ledger_dropped``). Every choice of a state reads
  it: ``membership_record.lead_of``, ``adoption.choose_source``, ``policy.out_of_cohort``,
  ``final_round``.

Pure: no torch, no hivemind.
"""

from __future__ import annotations

from collections.abc import Iterable

from open_diloco.outer.ledger import LedgerEntry


def roster_of(entry: LedgerEntry | None, galaxy_size: int, elastic: bool = False) -> frozenset[int]:
    """The roster a cluster's chain names at ``entry`` (its last), or every rank of a fixed galaxy; none
    before an elastic galaxy's first entry (its first round makes it)."""
    if entry is not None and entry.roster is not None:
        return frozenset(entry.roster)
    return frozenset() if elastic else frozenset(range(galaxy_size))


def has_quorum(members: Iterable[int], roster: Iterable[int], ended: Iterable[int] = ()) -> bool:
    """Whether a round with ``members`` may commit (see the module docstring); ``ended``: clusters whose
    records say they ended their run (they vote no more)."""
    voters = set(roster) - set(ended)
    if len(voters) <= 1:
        return True  # a galaxy of one, or everyone else ended: nobody to split from
    present = set(members) & voters
    return 2 * len(present) > len(voters) or (2 * len(present) == len(voters) and min(voters) in present)


def smallest_group(roster: Iterable[int], ended: Iterable[int], alive: int) -> int:
    """The fewest clusters a round's group may close with: a strict majority of the roster's voters while
    more than half of them are alive, else 2 (hivemind's own floor).

    Why: after a 30 s partition healed, two pairs of a 4-cluster galaxy met apart and one held the same round
    four times in 12 s (chaos soak `lan`, 2026-12-03): a group of two of four alive cannot commit (only the
    pair holding the lowest rank may, by the tie-break) and costs the others their attempt. Closing only a
    majority, the pairs keep looking and meet as three or four. A real split is not stalled for good: once
    the other side's records expire it is no longer alive, and the averager lowers the floor to 2 after the
    records' expiry in any case (``galaxy/paced_matchmaking.py``)."""
    voters = set(roster) - set(ended)
    if 2 * alive <= len(voters):
        return 2
    return max(2, min(alive, len(voters) // 2 + 1))


def next_roster(
    rosters: Iterable[Iterable[int] | None], members: Iterable[int], gone: Iterable[int]
) -> tuple[int, ...]:
    """A committed round's roster from what its members sent: their rosters (``None``: a member that sent
    none, as an older version), the members themselves, less the clusters some member saw leave."""
    members = set(members)
    joined = set(members).union(*(set(roster) for roster in rosters if roster is not None))
    return tuple(sorted(joined - (set(gone) - members)))
