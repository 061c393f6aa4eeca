"""This cluster's side of the deal (``outer/deal.py``): which page each inner step reads, and which of its
pages its Δ carries.

The deal a stride reads is its chain's latest: the hand the last entry holds for (stride, this cluster). Step
``s`` of the galaxy's clock is position i = (s − 1) mod T of stride (s − 1) // T + 1; it reads the hand's j-th
page, j the inner steps this cluster took in the stride before it (i with equal steps; fewer with
``--hv.round-steps by-speed``, which trains the first n pages of the hand and leaves the rest to come back).
A step without a page (no hand: the galaxy's first strides, a joiner's first) is not trained.

What the Δ carries is counted here, not guessed from the outcome of rounds: per stride, the range of the hand
trained since θ_local last went back to θ_outer (:meth:`OwnPages.reset`: a held round, a re-sync, a sit-out),
told to the galaxy in each round's metadata (``carries``). It is kept in checkpoints, so a resumed cluster
says what it said in the straight run.

Pure Python: no torch, no hivemind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from open_diloco.outer.deal import Deal, Hand
from open_diloco.outer.round_result import RoundResult

if TYPE_CHECKING:
    from open_diloco.config import HvConfig
    from open_diloco.outer.pacing import Pace


class OwnPages:
    """Which page each step of this cluster reads (:meth:`page_at`), what its Δ carries (:meth:`carries`)."""

    def __init__(
        self,
        galaxy_rank: int,
        stride: int,
        fragments: int,
        trains_at: Callable[[int], bool],
        by_speed: bool = False,
        deal_of: Callable[[], Deal | None] = lambda: None,
    ):
        self.galaxy_rank, self.stride, self.fragments = galaxy_rank, stride, fragments
        self.deal_of = deal_of
        """The deal of this cluster's chain now (its last entry's; ``None`` before any): what steps read."""
        self.trains_at = trains_at
        """The pacing's own decision (``Pace.trains_at``): which positions of a stride train, pages aside."""
        self.by_speed = by_speed
        """The plan of a stride is known only from its start (``--hv.round-steps by-speed``)."""
        self.carried: dict[int, list[int]] = {}
        """Stride → [first, last + 1] indices of its hand trained since θ_local was last θ_outer."""

    @staticmethod
    def of(hv: HvConfig, pace: Pace, deal_of: Callable[[], Deal | None]) -> OwnPages | None:
        """This cluster's pages in an elastic galaxy (``hv.elastic``), else ``None``: its data is its own."""
        if not hv.elastic:
            return None
        return OwnPages(hv.world_rank, pace.stride, hv.fragments, pace.trains_at, pace.by_speed, deal_of)

    def stride_of(self, step: int) -> tuple[int, int]:
        """(stride, position in it from 0) of galaxy step ``step`` (1-based)."""
        return (step - 1) // self.stride + 1, (step - 1) % self.stride

    def page_at(self, step: int) -> int | None:
        """The page galaxy step ``step`` reads, ``None`` when it has none (no hand, or the hand is spent)."""
        stride, position = self.stride_of(step)
        hand = self._hand(stride)
        if hand is None or not self.trains_at(step):
            return None
        index = self._index(step, position)
        return hand.pages[index] if index < len(hand.pages) else None

    def upcoming(self, step: int) -> list[int]:
        """The pages of the steps from ``step`` on, as far as the deal and the pacing's plan are known: the
        rest of this stride and every later stride dealt (with equal steps; by speed, a later stride's plan is
        made when its sync starts)."""
        pages: list[int] = []
        current, _ = self.stride_of(step)
        while self._hand(stride := self.stride_of(step)[0]) is not None:
            if self.by_speed and stride > current:
                break
            if (page := self.page_at(step)) is not None:
                pages.append(page)
            step += 1
        return pages

    def trained(self, step: int) -> None:
        """Galaxy step ``step`` trained its page: the Δ carries it (call before the sync after it starts)."""
        stride, position = self.stride_of(step)
        if self._hand(stride) is None:
            return
        index = self._index(step, position)
        span = self.carried.setdefault(stride, [index, index])
        span[1] = index + 1

    def _hand(self, stride: int) -> Hand | None:
        deal = self.deal_of()
        return None if deal is None else deal.hand(stride, self.galaxy_rank)

    def _index(self, step: int, position: int) -> int:
        """The inner steps this cluster took in the stride before galaxy step ``step`` (its ``position``)."""
        if not self.by_speed:
            return position
        return sum(self.trains_at(s) for s in range(step - position, step))

    def reset(self) -> None:
        """θ_local went back to θ_outer (every fragment): the Δ carries nothing trained before."""
        self.carried.clear()

    def round_ended(self, result: RoundResult) -> None:
        """Forget what the Δ carried when the round sent θ_local back to θ_outer (held, re-synced, sat out),
        and put the deal's figures in the round's record (``pages``, ``data_cursor``,
        ``data_committed_pages``)."""
        if result.dropped_progress:
            self.reset()
        entry = result.ledger
        if entry is not None and entry.dealt is not None:
            result.pages = (entry.pages or {}).get(str(self.galaxy_rank), [])
            result.data_cursor, result.data_committed_pages = entry.dealt.cursor, entry.dealt.committed

    def carries(self, round_no: int) -> dict[int, tuple[int, int]]:
        """What round ``round_no``'s Δ carries: per stride it covers (the last P up to its own), the range of
        the hand trained since the last reset."""
        covered = range(round_no - self.fragments + 1, round_no + 1)
        for stride in [s for s in self.carried if s < covered.start]:
            del self.carried[stride]
        return {stride: (span[0], span[1]) for stride, span in self.carried.items() if stride in covered}

    def contribution(self, round_no: int, local_steps: int) -> tuple[float, int, dict[str, list[int]]]:
        """(weight, pages carried, carries on the wire) of round ``round_no``'s Δ: it weighs the pages it
        carries over H, as ``--hv.round-steps by-speed`` weighs steps; a Δ of none (a stride without a hand:
        zero but for a codec's error feedback) as one page: hivemind takes no weight 0 from a peer that
        averages, and the guard's bounds are per unit of weight (a tiny one would bound its reducer by
        nothing)."""
        carries = self.carries(round_no)
        pages = sum(hi - lo for lo, hi in carries.values())
        weight = min(max(pages, 1), local_steps) / local_steps
        return weight, pages, {str(stride): [lo, hi] for stride, (lo, hi) in sorted(carries.items())}

    def state_dict(self) -> dict[str, Any]:
        return {str(stride): list(span) for stride, span in self.carried.items()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.carried = {int(stride): [int(lo), int(hi)] for stride, (lo, hi) in (state or {}).items()}
