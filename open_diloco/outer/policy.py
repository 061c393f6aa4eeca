"""What a round's outcome means: one decision from what the whole cluster saw of the round.

Kept apart from the mechanics so every rule is a line to read and a unit test to pin, and so later rules
(live membership, the guard) have one place to go."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal


class Decision(enum.Enum):
    APPLY = "apply"
    """Every cluster averaged and all started from the same θ_outer: apply the outer step."""
    PROCEED = "proceed"
    """Some live clusters were missing; apply the outer step with the average of those present."""
    RETRY = "retry"
    """Some live clusters were missing; recompute Δ and average again."""
    STOP = "stop"
    """Missing live clusters under ``--hv.on-partial-round fail``: stop the run."""


@dataclass(frozen=True)
class RoundOutcome:
    """A round as the whole cluster saw it (each field already agreed across the cluster's ranks)."""

    clusters: int
    """Clusters whose Δ went fully into the average, counted on the cluster's worst shard."""
    alive: int
    """Clusters the round should have had: the galaxy less those whose membership record says they left or
    went silent (this one included). A round of all of them is complete, however many --hv.galaxy-size
    says."""
    attempts: int
    """Retries already spent on this round."""


@dataclass(frozen=True)
class RoundPolicy:
    on_partial_round: Literal["retry", "proceed", "fail"] = "retry"
    max_retries: int = 2

    def decide(self, outcome: RoundOutcome) -> Decision:
        partial = outcome.clusters < outcome.alive
        if partial and self.on_partial_round == "fail":
            return Decision.STOP
        if partial and self.on_partial_round == "retry" and outcome.attempts < self.max_retries:
            return Decision.RETRY
        return Decision.PROCEED if partial else Decision.APPLY


def out_of_cohort(metadata: dict[Any, dict[str, Any]]) -> set[Any]:
    """The peers of a round that did not start it where its reference peer did: another round id or another
    θ_outer (hash: two sides of a partition that each trained on). The reference starts from the latest round,
    then from the chain with the most committed work (``work``: the rule of every heal, ``outer/quorum.py``),
    then from the θ_outer most peers of the group hold, then from the one committed by the most clusters
    (``committed_by``), then has the lowest galaxy rank: the state the galaxy has, not whichever rank is
    lowest. The others of its round and hash form the round's cohort. Every peer of a group holds the same
    gathered metadata, so every reducer leaves out the same peers, and the cohort's average stays bitwise
    identical and free of Δs taken from another θ_outer (or, with fragments, of another fragment). A peer
    without the keys is left to the claim checks."""
    valid = {
        key: meta
        for key, meta in metadata.items()
        if isinstance(meta, dict) and "round_id" in meta and "param_hash" in meta
    }
    if not valid:
        return set()
    holders = Counter(meta["param_hash"] for meta in valid.values())
    reference = max(
        valid.values(),
        key=lambda meta: (
            int(meta["round_id"]),
            int(meta.get("work") or 0),
            holders[meta["param_hash"]],
            int(meta.get("committed_by", 0)),
            -int(meta.get("galaxy_rank", 0)),
        ),
    )
    cohort = (reference["round_id"], reference["param_hash"])
    return {key for key, meta in valid.items() if (meta["round_id"], meta["param_hash"]) != cohort}
