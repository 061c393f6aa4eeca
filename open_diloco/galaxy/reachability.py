"""Can the other clusters dial this one? Asked of another cluster before the first round, answered in one line
per announced address.

A cluster that cannot be dialled breaks rounds in ways nobody can read (matchmaking timeouts, partial rounds)
unless it runs as a client of the all-reduce (``--hv.client-mode``). A process cannot test its own
reachability: dialling its own address from inside a NAT says nothing about the outside. So every cluster's
DHT node serves a *dial-back*: another peer sends it the addresses it announces, and it opens a plain TCP
connection to each (no libp2p handshake: "does a connection get through" is the question) and says what
happened. The stock ``hivemind-dht`` bootstrap peer does not serve it, so the first cluster of a galaxy has
nobody to ask and says so; every later one asks a cluster already there. libp2p's AutoNAT would answer the
same question, but it never dials private addresses, which is every address of a lab and of many galaxies'
private links.

A dial-back dials at most :data:`MAX_ADDRESSES` TCP addresses per request, each for at most
:data:`DIAL_SECONDS`, at most one request per peer every :data:`SERVE_INTERVAL`, and only for a peer on
``--hv.allowlist`` when there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr

from open_diloco.galaxy.dht import DHT_PIPE_LOCK

log = logging.getLogger(__name__)

DIAL_BACK = "open_diloco.dial_back"
CHECK_SECONDS = 30.0
"""How long a cluster looks for a peer to dial it back before it says it could not check."""
DIAL_SECONDS = 5.0
"""How long a dial-back waits for one TCP connection."""
MAX_ADDRESSES = 8
ASK_SECONDS = DIAL_SECONDS * MAX_ADDRESSES + 5.0
"""How long an asker waits for one peer's answer."""
RETRY_SECONDS = 2.0
SERVE_INTERVAL = 5.0
"""A peer gets at most one dial-back per this many seconds."""


@dataclass(frozen=True)
class DialResult:
    maddr: str
    reachable: bool
    error: str = ""


@dataclass(frozen=True)
class Reachability:
    """What a dial-back found, or why there was none (``checked_by`` empty)."""

    results: tuple[DialResult, ...]
    checked_by: str = ""
    reason: str = ""
    undialled: tuple[str, ...] = ()
    """Peers this cluster could not even dial (no answer came from anyone)."""

    @property
    def reachable(self) -> bool | None:
        """True when any announced address was dialled back, False when none was, None when unchecked."""
        return any(r.reachable for r in self.results) if self.checked_by else None

    def report(self, where: str) -> None:
        """Log :meth:`lines`, prefixed with ``where`` (which rank): as warnings when something cannot be
        dialled."""
        say = log.warning if self.reachable is False or self.undialled else log.info
        for line in self.lines():
            say("%s: %s", where, line)

    def lines(self) -> list[str]:
        """One line per address: what the operator reads before the first round."""
        if not self.checked_by:
            return [f"reachability not checked: {self.reason}"]
        by = f"another cluster ({self.checked_by[:16]}…)"
        return [
            f"reachable at {r.maddr} from {by}"
            if r.reachable
            else f"not reachable at {r.maddr} from {by} ({r.error}; a NAT or firewall?): open that port, set "
            "--hv.announce-maddrs to the public address, or use --hv.client-mode"
            for r in self.results
        ]


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """(host, port) of an /ip4, /ip6 or /dns* TCP multiaddr (a /p2p suffix is fine); None for anything else
    (QUIC, relay circuits), which a plain TCP dial cannot test."""
    try:
        addr = Multiaddr(maddr)
        protocols = [p.name for p in addr.protocols()]
        if "tcp" not in protocols or "p2p-circuit" in protocols:
            return None
        for name in ("ip4", "ip6", "dns", "dns4", "dns6"):
            if name in protocols:
                return addr.value_for_protocol(name), int(addr.value_for_protocol("tcp"))
    except (ValueError, TypeError, KeyError):
        return None
    return None


async def dial(maddr: str) -> DialResult:
    """A plain TCP connection to ``maddr``, closed at once."""
    endpoint = tcp_endpoint(maddr)
    if endpoint is None:
        return DialResult(maddr, False, "not a TCP address")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*endpoint), DIAL_SECONDS)
    except asyncio.TimeoutError:
        return DialResult(maddr, False, f"no answer within {DIAL_SECONDS:.0f} s")
    except OSError as err:
        return DialResult(maddr, False, err.strerror or type(err).__name__)
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    return DialResult(maddr, True)


_last_served: dict[str, float] = {}  # per asking peer, in the DHT process that serves


async def _serve(admitted: frozenset[str] | None, info: StreamInfo, reader, writer) -> None:
    try:
        asker = info.peer_id.to_base58()
        if admitted is not None and asker not in admitted:
            return
        if time.monotonic() - _last_served.get(asker, -SERVE_INTERVAL) < SERVE_INTERVAL:
            return  # one dial-back per peer per interval: the service is not a port scanner for hire
        _last_served[asker] = time.monotonic()
        request = json.loads(await asyncio.wait_for(P2P.receive_raw_data(reader), DIAL_SECONDS))
        maddrs = [str(m)[:300] for m in request.get("maddrs", [])][:MAX_ADDRESSES]
        results = await asyncio.gather(*(dial(m) for m in maddrs))
        payload = [{"maddr": r.maddr, "reachable": r.reachable, "error": r.error} for r in results]
        await P2P.send_raw_data(json.dumps(payload).encode(), writer)
    except (OSError, ValueError, AttributeError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        pass  # a caller that went away, or sent garbage (not a JSON object): nothing to answer
    finally:
        writer.close()


async def _register(_dht: DHT, node: DHTNode, admitted: frozenset[str] | None) -> None:
    await node.p2p.add_binary_stream_handler(DIAL_BACK, partial(_serve, admitted))


def serve_dial_back(dht: DHT, admitted: frozenset[str] | None) -> None:
    """Answer other clusters' dial-back requests from ``dht``'s process (only peers in ``admitted``, if
    given)."""
    with DHT_PIPE_LOCK:
        dht.run_coroutine(partial(_register, admitted=admitted), return_future=False)


async def _ask_one(node: DHTNode, peer: PeerID, maddrs: list[str]) -> tuple[str, list[dict[str, Any]]]:
    _, reader, writer = await node.p2p.call_binary_stream_handler(peer, DIAL_BACK)
    try:
        await P2P.send_raw_data(json.dumps({"maddrs": maddrs}).encode(), writer)
        return peer.to_base58(), json.loads(await P2P.receive_raw_data(reader))
    finally:
        writer.close()


def _read_outcome(ask: asyncio.Future) -> None:
    """Read how an ask ended, so that asyncio does not log an unread one as an ERROR with two tracebacks
    ("Task exception was never retrieved"; 2026-12-03 `home` chaos soak): a cancelled ask whose stream call
    ended in a p2p error instead, a second answer, a peer that refused the protocol (the bootstrap DHT)."""
    if not ask.cancelled():
        ask.exception()


def _read_when_done(awaitable: Any) -> asyncio.Future:
    """``awaitable`` as a future whose outcome is read when it ends (:func:`_read_outcome`)."""
    future = asyncio.ensure_future(awaitable)
    future.add_done_callback(_read_outcome)
    return future


async def _ask(
    _dht: DHT, node: DHTNode, maddrs: list[str], seconds: float
) -> tuple[str, list[dict[str, Any]], list[str]]:
    """Ask the peers, all at once, until one answers or ``seconds`` pass. Returns who answered and what,
    else ``("", [], peers that could not even be dialled)``."""
    deadline = time.monotonic() + seconds
    undialled: set[str] = set()
    while time.monotonic() < deadline:
        peers = await _candidates(node, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
        # the inner ask a task of our own too: wait_for would otherwise wrap it in one nobody reads
        asks = {
            _read_when_done(asyncio.wait_for(_read_when_done(_ask_one(node, p, maddrs)), ASK_SECONDS)): p
            for p in peers
        }
        pending = set(asks)
        try:
            while pending and time.monotonic() < deadline:
                done, pending = await asyncio.wait(
                    pending, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED
                )
                for ask in done:
                    if ask.exception() is None:
                        return (*ask.result(), [])
                    # the bootstrap answers "protocol not supported"; a peer nobody can dial, a dial error
                    peer = asks[ask].to_base58()
                    (undialled.add if "dial" in str(ask.exception()).lower() else undialled.discard)(peer)
            undialled.update(asks[ask].to_base58() for ask in pending)  # no stream within the deadline either
        finally:
            for ask in asks:
                ask.cancel()
        await asyncio.sleep(min(RETRY_SECONDS, max(0.0, deadline - time.monotonic())))
    return "", [], sorted(undialled)


async def _candidates(node: DHTNode, timeout: float) -> list[PeerID]:
    """The peers to ask: those connected now, and the DHT nodes nearest to this one (a lookup, which also
    finds a cluster that joined the DHT after this node did)."""
    peers = {p.peer_id for p in await node.p2p.list_peers()}
    with contextlib.suppress(Exception):
        nearest = await asyncio.wait_for(node.find_nearest_nodes([node.node_id], exclude_self=True), timeout)
        peers.update(peer for found in nearest.values() for peer in found.values())
    peers.discard(node.peer_id)
    return sorted(peers, key=str)


async def _check(
    _dht: DHT, node: DHTNode, seconds: float
) -> tuple[list[str], str, list[dict[str, Any]], list[str]]:
    """In the DHT's process: this node's TCP addresses, then :func:`_ask` about them (one request over the
    DHT's pipe, not two)."""
    tcp = [str(m) for m in await node.get_visible_maddrs() if tcp_endpoint(str(m)) is not None]
    if not tcp:
        return [], "", [], []
    return tcp, *await _ask(_dht, node, tcp, seconds)


def check_reachability(dht: DHT, seconds: float = CHECK_SECONDS) -> Reachability:
    """Ask another cluster to dial back each address ``dht`` announces; returns within about ``seconds``."""
    with DHT_PIPE_LOCK:  # (it runs in a thread beside the trainer's own DHT requests)
        future = dht.run_coroutine(partial(_check, seconds=seconds), return_future=True)
    try:
        tcp, by, answers, undialled = future.result(timeout=seconds + ASK_SECONDS)
    except Exception as err:  # a DHT that went away, a timeout: unchecked, never a hang
        return Reachability((), reason=f"the check failed ({type(err).__name__})")
    if not tcp:
        return Reachability((), reason="this cluster announces no TCP address to dial")
    if not by and undialled:
        return Reachability(
            (),
            reason=f"{len(undialled)} other peer(s) of the galaxy's DHT could not be dialled from here "
            f"within {seconds:.0f} s: if they and this cluster are all behind NATs, no round can form (a "
            "cluster that still cannot reach one of them stops; hivemind's relays carry too little for a "
            "round); a galaxy needs one cluster the others can dial: open its port (docs/networks.md)",
            undialled=tuple(undialled),
        )
    if not by:
        return Reachability(
            (),
            reason=f"no other cluster answered within {seconds:.0f} s (the first cluster of a galaxy has "
            "nobody to dial it back; the bootstrap hivemind-dht does not)",
        )
    results = tuple(DialResult(a["maddr"], bool(a["reachable"]), a.get("error", "")) for a in answers)
    return Reachability(results, checked_by=by)


def report_reachability_in_background(
    dht: DHT, where: str, seconds: float = CHECK_SECONDS
) -> threading.Thread:
    """Run :func:`check_reachability` beside the trainer and log its lines (``where``: which rank)."""

    thread = threading.Thread(
        target=lambda: check_reachability(dht, seconds).report(where), name="reachability-check", daemon=True
    )
    thread.start()
    return thread
