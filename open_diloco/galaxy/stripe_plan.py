"""Which part of a state to fetch from which holder next: the pure planning of a striped state download
(``galaxy/striped_download.py`` runs it over the network; no hivemind here, so it is unit-tested alone).

Why parts and several holders: a joiner that takes a shard's state from one cluster is bound by that cluster's
uplink (10 Mbit/s at a home site), while every other cluster at the same outer step with the same θ holds the
same bytes. Cut the state into fixed-size parts, each with its hash, and fetch them from every holder at once:
the download takes the holders' uplinks together. A part that fails, comes wrong or lags is fetched from
another holder; a holder that serves a wrong part, or fails twice, is dropped."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PART_BYTES = 4 << 20
"""The largest part: big enough that a request's round trip is small beside its transfer, small enough that a
lost part costs little to fetch again."""
MIN_PART_BYTES = 64 << 10
"""The smallest part, for small states: below it the requests' overhead dominates."""
PARTS_PER_HOLDER = 4
"""A state smaller than ``PART_BYTES`` × holders × this is cut finer, so every holder still gets parts."""
IN_FLIGHT_PER_HOLDER = 2
"""Parts asked of one holder at once: one on the wire while the next request crosses the link."""
STRIKES = 2
"""Failures (an error, an empty answer, a timeout) that drop a holder; a wrong hash drops it at once."""
HEDGE_AFTER_SECONDS = 1.0
"""With nothing left to assign, a part in flight this long (or 3 × the median part's time, when longer) is
asked of an idle holder too: the first answer wins."""


@dataclass(frozen=True)
class Part:
    """Values ``start:end`` of tensor ``tensor`` (flattened) of the state."""

    tensor: int
    start: int
    end: int


def part_bytes_for(state_bytes: int, holders: int) -> int:
    """The part size for a state of ``state_bytes`` over ``holders`` holders: :data:`PART_BYTES`, or finer so
    each holder gets :data:`PARTS_PER_HOLDER` parts, never under :data:`MIN_PART_BYTES`."""
    wanted = -(-state_bytes // max(1, holders * PARTS_PER_HOLDER))
    return max(MIN_PART_BYTES, min(PART_BYTES, wanted))


def split_into_parts(numels: list[int], part_values: list[int]) -> list[Part]:
    """Every tensor (of ``numels`` values) cut into parts of ``part_values`` values (the last one shorter)."""
    return [
        Part(index, start, min(start + step, numel))
        for index, (numel, step) in enumerate(zip(numels, part_values, strict=True))
        for start in range(0, numel, max(1, step))
    ]


@dataclass
class StripePlan:
    """The assignment of ``parts`` (their indices) to ``holders`` (names), updated as answers come in.

    Every call takes the time ``now`` explicitly, so the hedging rule is tested without waiting."""

    parts: list[Part]
    holders: list[str]
    in_flight_per_holder: int = IN_FLIGHT_PER_HOLDER
    pending: deque[int] = field(init=False)
    in_flight: dict[tuple[int, str], float] = field(init=False, default_factory=dict)
    """``(part, holder)`` → when it was asked."""
    failed_at: dict[int, set[str]] = field(init=False, default_factory=dict)
    """The holders that failed each part: never asked for it again."""
    landed_from: dict[int, str] = field(init=False, default_factory=dict)
    strikes: dict[str, int] = field(init=False, default_factory=dict)
    dropped: set[str] = field(init=False, default_factory=set)
    refetched: int = field(init=False, default=0)
    """Parts asked of a second holder (a failure, or a hedge against a slow one)."""
    part_seconds: list[float] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.pending = deque(range(len(self.parts)))

    @property
    def complete(self) -> bool:
        return len(self.landed_from) == len(self.parts)

    @property
    def live_holders(self) -> list[str]:
        return [holder for holder in self.holders if holder not in self.dropped]

    def hopeless(self) -> bool:
        """Some part can no longer come: every holder is dropped, or every live one failed that part."""
        live = set(self.live_holders)
        if not live:
            return not self.complete
        return any(
            live <= self.failed_at.get(index, set())
            for index in range(len(self.parts))
            if index not in self.landed_from
        )

    def next_for(self, holder: str, now: float) -> int | None:
        """The part ``holder`` should fetch now, recorded as in flight; ``None``: nothing for it (busy,
        dropped, or every part landed or asked elsewhere and not lagging)."""
        if holder in self.dropped or self._busy(holder) >= self.in_flight_per_holder:
            return None
        for index in list(self.pending):
            if holder not in self.failed_at.get(index, set()):
                self.pending.remove(index)
                self.in_flight[(index, holder)] = now
                return index
        lagging = self._lagging_part(holder, now)
        if lagging is not None:
            self.refetched += 1
            self.in_flight[(lagging, holder)] = now
        return lagging

    def landed(self, index: int, holder: str, now: float) -> bool:
        """``holder`` delivered part ``index`` with the right hash; ``True`` when it is the first to (the
        caller copies it into place), ``False`` for a hedge's second answer."""
        asked = self.in_flight.pop((index, holder), now)
        if index in self.landed_from:
            return False
        self.landed_from[index] = holder
        self.part_seconds.append(now - asked)
        return True

    def failed(self, index: int, holder: str, wrong: bool = False) -> None:
        """``holder`` did not deliver part ``index`` (``wrong``: its bytes did not match the hash): the part
        goes back to be asked elsewhere, and the holder takes a strike (dropped at :data:`STRIKES`, or at once
        when ``wrong``)."""
        self.in_flight.pop((index, holder), None)
        self.failed_at.setdefault(index, set()).add(holder)
        self.strikes[holder] = self.strikes.get(holder, 0) + 1
        if wrong or self.strikes[holder] >= STRIKES:
            self.drop(holder)
        self._requeue(index)

    def drop(self, holder: str) -> None:
        """Ask ``holder`` for nothing more; what it had in flight is asked elsewhere."""
        self.dropped.add(holder)
        for index, asked_of in list(self.in_flight):
            if asked_of == holder:
                del self.in_flight[(index, asked_of)]
                self._requeue(index)

    def _requeue(self, index: int) -> None:
        if index in self.landed_from or index in self.pending:
            return
        if any(part == index for part, _ in self.in_flight):
            return  # a hedge of it is still on its way
        self.refetched += 1
        self.pending.appendleft(index)

    def _busy(self, holder: str) -> int:
        return sum(1 for _, asked_of in self.in_flight if asked_of == holder)

    def _lagging_part(self, holder: str, now: float) -> int | None:
        """The part asked longest ago of a single other holder, when it has been out longer than the hedge
        threshold and ``holder`` never failed it."""
        typical = statistics.median(self.part_seconds) if self.part_seconds else 0.0
        threshold = max(HEDGE_AFTER_SECONDS, 3 * typical)
        askers: dict[int, list[str]] = {}
        for (index, asked_of), _ in self.in_flight.items():
            askers.setdefault(index, []).append(asked_of)
        candidates = [
            (asked, index)
            for (index, asked_of), asked in self.in_flight.items()
            if len(askers[index]) == 1
            and asked_of != holder
            and now - asked > threshold
            and holder not in self.failed_at.get(index, set())
        ]
        return min(candidates)[1] if candidates else None

    def parts_by_holder(self) -> dict[str, int]:
        """How many of the landed parts each holder delivered (every holder named, 0 included)."""
        counts = dict.fromkeys(self.holders, 0)
        for holder in self.landed_from.values():
            counts[holder] += 1
        return counts
