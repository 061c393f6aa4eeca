"""Two clusters that cannot reach each other stop at start, in one line, instead of training apart for good.

Two clusters behind NATs (or firewalls that drop what comes in) can neither dial the other: no round
between them ever forms, and each would retry, then apply its own Δ alone, round after round. libp2p relays
could carry the connection, but hivemind's carry at most 128 KiB per connection, too little for a round
(docs/networks.md; ``tests/wan/test_nat.py`` shows it). So a cluster that finds itself in that state stops
and says what to open.

The evidence is a ping from this rank's DHT node to the other cluster's shard peer: it answers if either side
can dial the other (a connection the other side opened carries it too). Both clusters still publish their
records through the DHT's reachable bootstrap peer, so a fresh record with no answer behind it means "alive,
and out of reach". A partition cuts a cluster off the DHT too: its record goes stale within
``--hv.member-expiry`` and it stops counting here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID

from open_diloco.galaxy.dht import DHT_PIPE_LOCK, answers_ping
from open_diloco.galaxy.reachability import CHECK_SECONDS
from open_diloco.membership_record import MemberRecord

CUT_OFF = "cannot reach each other"
"""In the line of a cluster that stops here, and so in its record's final state: the other side, which may not
have got there yet, reads it and stops too."""
KNOWN_SECONDS = CHECK_SECONDS + 10.0
"""How long a cluster's peer must have been known before its silence counts: by then its own reachability
check has dialled this cluster, if it could."""
UNANSWERED_SECONDS = 30.0
"""How long at least its pings must go unanswered, while its record stays fresh, before this cluster stops;
and at least twice ``--hv.member-expiry``, so that a cluster cut off the DHT by a partition goes stale
first."""
PING_SECONDS = 5.0
"""How often, and how long, a ping waits."""


class CutOffWatch:
    """Watches, until this cluster's first round with another, for a live cluster it cannot reach either way.
    Rounds read the membership at every start and every 2 s while they look for a group: :meth:`line` runs
    there, and pings at most every :data:`PING_SECONDS`."""

    def __init__(self, dht: DHT, galaxy_rank: int, shard_index: int, member_expiry: float):
        self.dht, self.galaxy_rank, self.shard_index = dht, galaxy_rank, shard_index
        self.unanswered_seconds = max(UNANSWERED_SECONDS, 2 * member_expiry)
        self._first_seen: dict[str, float] = {}
        self._unanswered_since: dict[str, float] = {}
        self._pinged = float("-inf")

    def line(self, records: list[MemberRecord], gone: frozenset[int], averaged: bool) -> str | None:
        """Why this cluster stops, or None. ``averaged``: it has had a round with another cluster (a later
        loss of contact is a partition, which heals). A cluster that stopped for this same reason counts as
        out of reach if it was before it stopped."""
        if averaged:
            return None
        now, live, stopped = time.monotonic(), {}, {}
        for record in records:
            rank, peer = record.galaxy_rank, record.shard_peer(self.shard_index)
            if rank == self.galaxy_rank or peer is None:
                continue
            if rank not in gone:
                if now - self._first_seen.setdefault(peer, now) > KNOWN_SECONDS:
                    live[rank] = peer
            elif CUT_OFF in str(record.state):
                stopped[rank] = peer
        for peer in set(self._unanswered_since) - set(live.values()) - set(stopped.values()):
            del self._unanswered_since[peer]  # gone quiet (a partition, an exit): not this
        if live and now - self._pinged >= PING_SECONDS:
            self._pinged = now
            answered = _answering(self.dht, list(live.values()))
            for peer in live.values():
                if peer in answered:
                    self._unanswered_since.pop(peer, None)
                else:
                    self._unanswered_since.setdefault(peer, now)
        cut = sorted(
            rank
            for rank, peer in {**live, **stopped}.items()
            if peer in self._unanswered_since
            and (rank in stopped or now - self._unanswered_since[peer] >= self.unanswered_seconds)
        )
        if not cut:
            return None
        return (
            f"this cluster and cluster(s) {cut} {CUT_OFF}: neither side could open a connection to the other "
            "since start (both behind NATs or firewalls?), so no round can form; open one cluster's port "
            "(--hv.host-maddrs, and --hv.announce-maddrs with its public address) or run both with "
            "--hv.client-mode beside a cluster both can dial; relays carry too little (docs/networks.md)"
        )


def _answering(dht: DHT, peers: list[str]) -> set[str]:
    """Which of ``peers`` (PeerIDs, base58) answer a DHT ping from this node within :data:`PING_SECONDS`."""
    with DHT_PIPE_LOCK:
        future = dht.run_coroutine(functools.partial(_ping_all, peers), return_future=True)
    try:
        return future.result(timeout=PING_SECONDS + 5.0)
    except Exception:  # a DHT that went away, a timeout: count it as no answer, the next read asks again
        return set()


async def _ping_all(peers: list[str], _dht: DHT, node: DHTNode) -> set[str]:
    async def ping(peer: str) -> str | None:
        with contextlib.suppress(Exception):
            if await answers_ping(node, PeerID.from_base58(peer), PING_SECONDS):
                return peer
        return None

    return {peer for peer in await asyncio.gather(*map(ping, peers)) if peer is not None}
