"""How long a round's matchmaking waits, from the link and from the galaxy's own round history.

hivemind's matchmaking takes three numbers, fixed at the averager's start until now: how long the first peer
of a group waits for the others (``min_matchmaking_time``: ``--hv.matchmaking-time``), how long a join request
waits for a leader's answer (``request_timeout``: it was ``min(3, --hv.matchmaking-time / 2)``) and how many
peers make a group full (``target_group_size``: the whole galaxy). None of them knew the link or the galaxy:

- a full group forms the moment its last peer joins, so the window costs nothing when every live cluster
  comes, and the whole window when one will not. With a cluster gone, every round waited the window out
  for it (the group never filled), although the membership records already said it was gone;
- the window has to cover how far apart the clusters arrive plus the DHT reads that find the leader. Over
  `intercontinental` (150 ms RTT), 4 clusters × 2 ranks, whole rounds took 2–6 s to form against a 2 s
  window: users tuned ``--hv.matchmaking-time 8`` by hand;
- a join request's answer takes a round trip and, on a lossy link, a TCP retransmission (≥ 200 ms more), and
  on a loaded host the leader's averager process answers late whatever the link.

:class:`MatchmakingClock` keeps the round trips this shard measured to its counterparts (DHT pings,
``galaxy/link_probe.py``) and how long its whole rounds took to form, and plans each round
(:class:`MatchmakingPlan`): the group is full at the clusters alive; the window is the longest of
``--hv.matchmaking-time``, 20 round trips (the DHT lookups that find a leader, before any round has formed)
and 1.5 × the 90th percentile of recent whole rounds' matchmaking (a live cluster slower than that is late,
not coming: its round goes on without it and it takes the result); a join request waits what the old rule
gave at this window (``min(3 s, window / 2)``: a loaded host's answer), or 4 round trips plus one
retransmission where that is longer. Pure Python: ``galaxy/averager.py`` feeds it, the outer loop agrees the
plan across the cluster's ranks (every shard's group then waits as long).

Why the old rule stays the join request's floor: the first 4 × 2 soak over `intercontinental` with the
request wait from round trips alone (1–1.3 s at a 150 ms RTT) split rounds into groups of two under a load
average of 18 (19 % of fault-free syncs retried, docs/results/chaos-soak.md): a follower that gives up on a
slow leader's answer joins another, and two groups form.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

HISTORY = 32
"""Samples kept of each kind: round trips, and whole rounds' matchmaking seconds."""
WINDOW_FACTOR = 1.5
"""The window over the 90th percentile of whole rounds' matchmaking: room for a round a little slower than
most, not for one that waits on a cluster that will not come."""
REQUEST_RTTS = 4
"""Round trips a join request's answer may take: the request, the leader's answer, and a new stream's
negotiation on the way."""
RETRANSMIT_SECONDS = 0.5
"""One lost packet's TCP retransmission (RTO ≥ 200 ms plus the round trip), beside the round trips."""
WINDOW_RTTS = 20
"""Round trips the window covers at least: a peer finds the leader through DHT reads (several round trips
each, paced at 0.2 s) before it can ask to join. Before any whole round, this is what knows the link."""
REQUEST_CAP_SECONDS = 3.0
"""The old rule's ceiling of a join request's wait (``min(3, window / 2)``), kept as its floor below."""


@dataclass(frozen=True)
class MatchmakingPlan:
    """One round's matchmaking, as hivemind takes it."""

    window: float
    """Seconds from the round's start to the declared expiration: how long the first peer waits for others."""
    request_timeout: float
    """Seconds a join request waits for the leader's answer."""
    group_size: int
    """Peers that make the group full: it forms at once when that many joined."""
    waits_for_behind: bool = False
    """The window waits for a live cluster still on its way from an earlier round
    (:meth:`MatchmakingClock.plan`): its matchmaking seconds measure that cluster's lateness, not how long a
    group takes to form."""
    min_group: int = 2
    """The fewest peers a group may close with when the window ends (hivemind's ``min_group_size``): a
    majority of the roster while more than half of it is alive (``quorum.smallest_group``), else 2."""

    def agreed(self, min_int: Callable[[int], int]) -> MatchmakingPlan:
        """The plan every rank of the cluster runs (``min_int``: the cluster's, ``ClusterComm.min_int``): the
        longest window and request wait any rank planned (each shard measured its own link), so that one
        shard's group does not give up on a cluster that another shard's still waits for."""
        window = -min_int(-math.ceil(self.window * 1000)) / 1000
        request = -min_int(-math.ceil(self.request_timeout * 1000)) / 1000
        group = -min_int(-self.group_size)
        behind = min_int(0 if self.waits_for_behind else 1) == 0  # any rank's: its window is the longest
        smallest = min(group, -min_int(-self.min_group))
        return MatchmakingPlan(window, request, group, behind, smallest)


class MatchmakingClock:
    """Round trips and whole rounds' matchmaking seconds of one shard, and the plan they give."""

    def __init__(self, floor: float, ceiling: float):
        """``floor``: ``--hv.matchmaking-time`` (the window is never shorter); ``ceiling``: the longest window
        (a quarter of ``--hv.averaging-timeout``: a round must leave time to exchange and to retry)."""
        self.floor, self.ceiling = floor, max(floor, ceiling)
        self.round_trips: deque[float] = deque(maxlen=HISTORY)
        self.formed: deque[float] = deque(maxlen=HISTORY)

    def observe_round_trip(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.round_trips.append(seconds)

    def observe_round(self, matchmaking_seconds: float, whole: bool) -> None:
        """A round's matchmaking; only a whole round (every live cluster came) says how long one takes to
        form: a partial one waited the window out for a cluster that did not come."""
        if whole and math.isfinite(matchmaking_seconds) and matchmaking_seconds >= 0:
            self.formed.append(matchmaking_seconds)

    def round_trip(self) -> float | None:
        """The 90th percentile of the measured round trips; ``None`` before the first."""
        return percentile(self.round_trips, 0.9)

    def plan(self, live_clusters: int, coming: bool = False) -> MatchmakingPlan:
        """``coming``: a live cluster's record shows it still in an earlier round (finishing its stride, or
        taking the last round's result: a 4 MB state over `home` took 12-20 s). The window then waits the
        ceiling for it, since the group forms the moment it joins; a window the usual length went on without
        it, it came late to the next round by its download too, and each such round was retried until the
        last attempt (the `home` soak of 2026-12-02: 8 of 13 galaxy-wide retried rounds)."""
        rtt, formed = self.round_trip(), percentile(self.formed, 0.9)
        window = self.floor
        if rtt is not None:
            window = max(window, WINDOW_RTTS * rtt)
        if formed is not None:
            window = max(window, WINDOW_FACTOR * formed)
        window = min(window, self.ceiling)
        request = min(REQUEST_CAP_SECONDS, window / 2)
        if rtt is not None:
            request = max(request, min(REQUEST_RTTS * rtt + RETRANSMIT_SECONDS, window / 2))
        if coming:
            return MatchmakingPlan(self.ceiling, request, live_clusters, waits_for_behind=True)
        return MatchmakingPlan(window, request, live_clusters)


def percentile(samples: deque[float] | list[float], q: float) -> float | None:
    """The ``q`` quantile of ``samples`` (nearest rank, the sample itself: no interpolation); ``None`` if
    empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
