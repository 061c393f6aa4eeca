"""Round trips from this shard's DHT node to its counterparts in the other live clusters, measured in the
background for the matchmaking clock (``outer/matchmaking.py``).

A round trip is one DHT ping (``call_ping``), timed inside the DHT's process: the same libp2p connection,
daemon and Python event loop that a matchmaking request crosses, so a loaded host or a lossy link shows in it
as it shows in matchmaking. Rounds read the membership at every start and every 2 s while they look for a
group; :meth:`LinkProbe.poll` runs there, collects what the last pings measured and sends new ones at most
every :data:`PROBE_SECONDS`, never waiting for an answer: a probe costs a round nothing."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Any

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID

from open_diloco.galaxy.dht import DHT_PIPE_LOCK
from open_diloco.outer.matchmaking import MatchmakingClock

PROBE_SECONDS = 10.0
"""How often this shard pings its counterparts."""
PING_TIMEOUT_SECONDS = 5.0
"""A ping unanswered by then measures nothing (a peer gone or cut off is membership's business)."""


class LinkProbe:
    """Pings the live counterparts now and then; every answer's round trip goes to ``clock``."""

    def __init__(self, dht: DHT, clock: MatchmakingClock):
        self.dht, self.clock = dht, clock
        self._sent = float("-inf")
        self._in_flight: Any = None  # hivemind's MPFuture of the last probe's round trips

    def poll(self, peers: list[str]) -> None:
        """Take the answers of the last probe if they came; probe ``peers`` (PeerIDs, base58) again when
        :data:`PROBE_SECONDS` passed and none is in flight."""
        if self._in_flight is not None and self._in_flight.done():
            with contextlib.suppress(Exception):  # a DHT gone or a timeout measured nothing
                for seconds in self._in_flight.result():
                    self.clock.observe_round_trip(seconds)
            self._in_flight = None
        if self._in_flight is None and peers and time.monotonic() - self._sent >= PROBE_SECONDS:
            self._sent = time.monotonic()
            with contextlib.suppress(Exception), DHT_PIPE_LOCK:
                self._in_flight = self.dht.run_coroutine(
                    functools.partial(_round_trips, list(peers)), return_future=True
                )


async def _round_trips(peers: list[str], _dht: DHT, node: DHTNode) -> list[float]:
    """Each answering peer's ping round trip in seconds (in the DHT's process)."""

    async def ping(peer: str) -> float | None:
        start = time.monotonic()
        with contextlib.suppress(Exception):
            answer = node.protocol.call_ping(PeerID.from_base58(peer), validate=False, strict=False)
            if await asyncio.wait_for(answer, PING_TIMEOUT_SECONDS) is not None:
                return time.monotonic() - start
        return None

    return [seconds for seconds in await asyncio.gather(*map(ping, peers)) if seconds is not None]
