"""What a pseudo-gradient must look like to enter the galaxy's average: the content half of the galaxy guard.

Every cluster claims its shard's ‖Δ‖ (of exactly what it sends) in the metadata hivemind gathers during
matchmaking, so each peer of a round holds the same table of claims before any part moves. Two checks use it:

- **sender side** (:class:`NormHistory`): a cluster whose own Δ is more than ``--hv.delta-norm-bound`` times
  the galaxy's recent median (the median of the accepted claims of each of its last rounds), or more than
  :data:`THETA_FACTOR` times the norm of the θ_outer it was taken from, does not send it; it sits the round
  out and adopts the galaxy's θ_outer, like a cluster whose Δ is not finite. A fresh or resumed cluster has no
  history yet: in its first round only the θ bound holds.
- **reducer side** (:class:`ClaimCheck`): a reducer leaves a sender out of its span when the sender's claim is
  missing, not finite, or more than ``--hv.delta-norm-bound`` times the reducer's *own* claim, and stops
  accepting a sender whose parts add up to more than it claimed (a liar); :data:`THETA_FACTOR` × the reducer's
  own ‖θ_outer‖ bounds every claim too. The reference is the reducer's own Δ because it is the one norm
  another peer cannot move: with two clusters a median of the round is half the
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
THETA_FACTOR = 100.0
"""No round of training moves the weights by 100x their own norm: AdamW moves each value by about the lr per
step, so even H = 500 steps at lr 3e-4 move a value by 0.15 at most, against weights of ~0.02 at init (7.5x,
and honest updates mostly cancel: ‖Δ‖ is well below ‖θ_outer‖ in practice, even at the tests' lr of 1e-2). A Δ
above it has diverged. θ_outer is the same in every cluster of a round, so this bound needs no history: it
covers a cluster's first round, before the galaxy's median exists."""
CLAIM_SLACK = 1.01
"""How far a sender's parts may exceed its claimed ‖Δ‖² at a reducer: fp16 on the wire moves each value by up
to 2^-11, and the reducer sums in fp32 in another order than the sender did."""


def wire_norm(flat: torch.Tensor) -> float:
    """‖x‖ of what this cluster sends (the claim other peers hold it to)."""
    return float(torch.linalg.vector_norm(flat))


def valid_weight(value: object) -> float | None:
    """A sender's averaging weight as a number in (0, 1], ``None`` when it is anything else: a weight above
    1 would give one cluster the say of several (``--hv.round-steps by-speed`` weighs a Δ by its share of a
    round's steps, 1 at most; with equal steps every weight is 1). Missing (a version before weights): 1."""
    if value is None:
        return 1.0
    number = valid_claim(value)  # a finite, non-negative number, as a claim must be
    return number if number is not None and 0 < number <= 1 else None


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

    def bound(self, theta_norm: float | None = None, weight: float = 1.0) -> float | None:
        """The largest ‖Δ‖ this cluster may send, given the norm of the θ_outer its Δ was taken from and its
        weight (its share of a round's steps: a Δ of half the steps is held to half the history's norm);
        ``None`` when the check is off, or there is neither a history nor a θ norm."""
        if self.factor <= 0:
            return None
        bounds = [self.factor * weight * statistics.median(self._medians)] if self._medians else []
        if theta_norm:
            bounds.append(THETA_FACTOR * theta_norm)
        return min(bounds, default=None)

    def record(self, claims: Iterable[object]) -> None:
        """Add one round: the claims of the clusters whose Δ entered the average, each over its weight (a
        norm per round's worth of steps; the claims themselves with equal steps). A claim of exactly 0 says
        nothing of the galaxy's scale (a cluster that sends a fragment it has just taken from the galaxy, with
        no inner step since): counted, a few of them made the median, and so the bound, 0, and every healthy Δ
        after it "out of bound" until the cluster stopped as diverging."""
        values = [claim for claim in map(valid_claim, claims) if claim is not None and claim > 0]
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
    own_theta: float | None = None
    """This reducer's ‖θ_outer‖ (``None``: unknown, no θ bound)."""
    stale: frozenset = frozenset()
    """Peers outside the round's cohort (``policy.out_of_cohort``): never averaged, this reducer included."""
    weights: dict[Hashable, float] = field(default_factory=dict)
    """Every peer's averaging weight as gathered (``--hv.round-steps by-speed``; absent: 1). Claims compare
    per unit of weight: a cluster that took twice the steps has a larger Δ, legitimately."""
    _energy: dict[Hashable, float] = field(default_factory=dict)

    def weight(self, peer: Hashable) -> float:
        """The weight ``peer`` gathered (1 when none)."""
        return self.weights.get(peer, 1.0)

    def admits(self, sender: Hashable) -> bool:
        """Whether ``sender`` may enter this reducer's span at all (decided before its first part): a valid
        claim, within :data:`THETA_FACTOR` × our ‖θ_outer‖ and, per unit of weight, within
        ``--hv.delta-norm-bound`` × our own."""
        claim = self.claims.get(sender)
        if claim is None or sender in self.stale:
            return False
        if self.factor <= 0:
            return True
        if self.own_theta and claim > THETA_FACTOR * self.own_theta:
            return False
        reference = self.claims.get(self.own)  # none of our own, or an all-zero Δ: nothing to compare to
        if not reference:
            return True
        return claim / self.weight(sender) <= self.factor * reference / self.weight(self.own)

    def scale(self, sender: Hashable) -> float:
        """What ``sender``'s parts are multiplied by: 1, or with the robust mean, median claim ÷ its claim
        when larger. The median is over every valid claim, the same on every reducer."""
        claim = self.claims.get(sender)
        valid = [value for peer, value in self.claims.items() if value is not None and peer not in self.stale]
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
