"""Goodput: the share of the tokens a cluster computed that the galaxy committed into θ_outer.

Why it is counted from the ledger and not from the rounds' outcomes: a round this cluster committed can
still be lost later, when the cluster takes another chain (a fork the galaxy did not keep drops its
entries). The tokens committed are what the chain this cluster holds says it put in: its own contribution
to every entry that names it a member (its inner steps behind its Δ times the tokens of its inner step, over
``--hv.fragments``, as ``LedgerEntry.tokens`` counts them). Tokens computed are every inner step it
trained, a stride trained again after a held round included: that stride is the waste goodput is there to
show. A cluster that computes less does not raise its goodput by it: the galaxy's tokens per second stand
beside it (``open-diloco status``).

Both counts are kept in checkpoints (``goodput``), so a resumed run goes on counting. The steps a killed
launch trained after its last checkpoint are not in ``computed`` (its metrics records show them), though a
round the galaxy committed with them is in ``committed`` once the restart takes the galaxy's chain: those
tokens were computed, so ``computed`` is raised to ``committed`` where it fell below (a cluster killed twice
in the chaos soak read 100.2 %); the rest of the lost launch's steps stay uncounted, so after a crash the
ratio can still read a little high.

Pure Python: no torch, no hivemind.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from open_diloco.outer.ledger import LedgerEntry


@dataclass
class Goodput:
    """This cluster's tokens computed and committed (the same on every rank of the cluster)."""

    galaxy_rank: int
    tokens_per_step: int
    """The tokens of one inner step of this cluster (every rank's batch)."""
    local_steps: int
    """H: the inner steps a contribution holds when its entry does not say."""
    fragments: int = 1
    computed: int = 0
    """Tokens of every inner step this cluster trained."""
    committed: int = 0
    """Tokens of this cluster's own in the chain it holds."""

    def trained(self, steps: int = 1) -> None:
        self.computed += steps * self.tokens_per_step

    def own_tokens(self, entry: LedgerEntry) -> int:
        """This cluster's tokens in ``entry`` (0 when it is no member of it)."""
        member = next((m for m in entry.members if m.rank == self.galaxy_rank), None)
        if member is None:
            return 0
        steps = self.local_steps if member.inner_steps is None else member.inner_steps
        return steps * self.tokens_per_step // self.fragments

    def appended(self, entry: LedgerEntry) -> None:
        """This cluster committed ``entry`` at the end of its chain."""
        self.committed += self.own_tokens(entry)

    def chain_changed(self, before: Iterable[LedgerEntry], after: list[LedgerEntry]) -> None:
        """The chain went from ``before`` to ``after`` (another cluster's chain taken): count the entries that
        came in and take out the ones that left, except those that only
        fell off its front (``ledger.KEEP``: still committed, just no longer kept)."""
        held = {entry.hash: entry for entry in before}
        now = {entry.hash for entry in after}
        first = after[0].round if after else 0
        came = sum(self.own_tokens(entry) for entry in after if entry.hash not in held)
        left = sum(
            self.own_tokens(entry) for key, entry in held.items() if key not in now and entry.round >= first
        )
        self.committed += came - left
        # a restart took the galaxy's chain, with rounds its killed launch computed after its last checkpoint
        self.computed = max(self.computed, self.committed)

    @property
    def ratio(self) -> float | None:
        """Tokens committed ÷ tokens computed (``None`` before the first trained step)."""
        return self.committed / self.computed if self.computed else None

    def metrics(self) -> dict[str, Any]:
        """The metrics keys (new keys of the public contract): ``tokens_computed``, ``tokens_committed``
        and, once a step was trained, ``goodput``."""
        record: dict[str, Any] = {"tokens_computed": self.computed, "tokens_committed": self.committed}
        if (ratio := self.ratio) is not None:
            record["goodput"] = round(ratio, 6)
        return record

    def state_dict(self) -> dict[str, int]:
        return {"computed": self.computed, "committed": self.committed}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's counts; none (a checkpoint from before goodput was counted): from zero."""
        state = state or {}
        self.computed, self.committed = int(state.get("computed", 0)), int(state.get("committed", 0))


def share(counts: Iterable[tuple[int | None, int | None]]) -> float | None:
    """Tokens committed ÷ tokens computed over several clusters' ``(computed, committed)`` counts (those that
    counted nothing left out); ``None`` when none did: the galaxy's goodput (``open-diloco status``, the chaos
    soak's summary)."""
    said = [(computed, committed or 0) for computed, committed in counts if computed]
    total = sum(computed for computed, _ in said)
    return sum(committed for _, committed in said) / total if total else None
