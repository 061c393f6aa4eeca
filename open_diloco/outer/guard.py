"""What a pseudo-gradient must look like to enter the galaxy's average: the content half of the galaxy guard.

Every cluster claims its shard's ‖Δ‖ (of exactly what it sends) in the metadata hivemind gathers during
matchmaking, so each peer of a round holds the same table of claims before any part moves. Two checks use it:

- **sender side** (:class:`NormHistory`): a cluster whose own Δ is more than ``--hv.delta-norm-bound`` times
  the galaxy's recent median (the median of the accepted claims of each of its last rounds) does not send it;
  it sits the round out and adopts the galaxy's θ_outer, like a cluster whose Δ is not finite. A fresh or
  resumed cluster has no history yet: its first round is judged by the reducers alone.
- **reducer side** (:class:`ClaimCheck`): a reducer leaves a sender out of its span when the sender's claim is
  missing, not finite, or more than ``--hv.delta-norm-bound`` times the reducer's *own* claim, and stops
  accepting a sender whose parts add up to more than it claimed (a liar). The reference is the reducer's own
  Δ because it is the one norm another peer cannot move: with two clusters a median of the round is half the
  attacker's. Honest clusters train the same model with the same optimizer, so their Δ norms stay within a
  small factor of each other (AdamW bounds each step by the lr); the default bound of 10 leaves room for that.
  Reducers may differ at the edge (a claim 10.5× one reducer's Δ and 9.5× another's): each span still has one
  reducer, so every peer still ends the round with the same bytes.

``--hv.robust-mean`` (off by default) also clips every sender's Δ to the median claim of the round before
averaging (each reducer scales that sender's parts by the same factor, since all hold the same claims).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

HISTORY_ROUNDS = 5
"""Rounds whose median claims make up the galaxy's recent median (the sender-side reference)."""
CLAIM_SLACK = 1.01
"""How far a sender's parts may exceed its claimed ‖Δ‖² at a reducer: fp16 on the wire moves each value by up to
2^-11, and the reducer sums in fp32 in another order than the sender did."""


def wire_norm(flat: torch.Tensor) -> float:
    """‖x‖ of what this cluster sends (the claim other peers hold it to)."""
    return float(torch.linalg.vector_norm(flat))


def valid_claim(value: object) -> float | None:
    """A claim as a number, or ``None`` when it is missing or no finite, non-negative number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


class NormHistory:
    """The galaxy's recent ‖Δ‖ medians as this cluster saw them, and the bound they set for its own Δ."""

    def __init__(self, factor: float, rounds: int = HISTORY_ROUNDS):
        self.factor = factor
        self._medians: deque[float] = deque(maxlen=rounds)

    def bound(self) -> float | None:
        """The largest ‖Δ‖ this cluster may send; ``None`` while there is no history or the check is off."""
        if self.factor <= 0 or not self._medians:
            return None
        return self.factor * statistics.median(self._medians)

    def record(self, claims: Iterable[object]) -> None:
        """Add one round: the claims of the clusters whose Δ entered the average."""
        values = [claim for claim in map(valid_claim, claims) if claim is not None]
        if values:
            self._medians.append(statistics.median(values))


@dataclass
class ClaimCheck:
    """A reducer's judgement of the senders of one round, from the claims gathered in matchmaking."""

    claims: dict[Hashable, float | None]
    """Every peer's claimed ‖Δ‖ (``None``: missing or invalid), keyed by peer."""
    own: Hashable
    """This reducer's key in ``claims``."""
    factor: float
    """``--hv.delta-norm-bound``; 0 turns the bound off (claims are still held to)."""
    robust: bool = False
    """``--hv.robust-mean``: clip every sender to the round's median claim."""
    _energy: dict[Hashable, float] = field(default_factory=dict)

    @property
    def bound(self) -> float | None:
        reference = self.claims.get(self.own)
        if self.factor <= 0 or not reference:  # no claim of our own (or an all-zero Δ): nothing to compare to
            return None
        return self.factor * reference

    def admits(self, sender: Hashable) -> bool:
        """Whether ``sender`` may enter this reducer's span at all (decided before its first part)."""
        claim = self.claims.get(sender)
        if claim is None:
            return False
        bound = self.bound
        return bound is None or claim <= bound

    def scale(self, sender: Hashable) -> float:
        """What ``sender``'s parts are multiplied by: 1, or with the robust mean, median claim ÷ its claim when
        larger. The median is over every valid claim, the same on every reducer."""
        claim = self.claims.get(sender)
        valid = [value for value in self.claims.values() if value is not None]
        if not self.robust or not claim or not valid:
            return 1.0
        return min(1.0, statistics.median(valid) / claim)

    def within_claim(self, sender: Hashable, part: torch.Tensor) -> bool:
        """Count ``part`` (as received, before any scaling) towards ``sender``'s energy; ``False`` once the
        parts it sent to this reducer add up to more than the whole Δ it claimed."""
        claim = self.claims.get(sender) or 0.0
        energy = self._energy.get(sender, 0.0) + float(torch.linalg.vector_norm(part)) ** 2
        self._energy[sender] = energy
        return energy <= claim**2 * CLAIM_SLACK + 1e-30
