"""Starting this shard's DHT node with one-line errors, and stopping it within a bound."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import socket
import threading
from collections.abc import Sequence

from hivemind import DHT
from hivemind.dht import dht as hivemind_dht
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from open_diloco.addresses import listen_address, peer_address
from open_diloco.errors import ConfigError
from open_diloco.galaxy.lifecycle import become_galaxy_child, end_child
from open_diloco.galaxy.task_refs import hold_tasks_in_loops_of

DHT_PIPE_LOCK = threading.Lock()
"""hivemind's DHT takes requests through one pipe and no lock: every thread of this process that sends one
(the status publisher, the round's membership read, the reachability check) holds this while it sends, so
their messages never interleave."""

SHUTDOWN_SECONDS = 2.0
"""What hivemind's DHT gets to shut down in order before it is ended by PID (with its p2pd)."""

NEW_DHT_START_SECONDS = 60.0
"""The bound on starting a new DHT (no initial peers): nothing is joined, the wait is this machine's own
(a fork and a p2pd daemon: 0.2 s idle, ~1 s beside eight CPU burners, once over 10 s in a loaded CI run),
so ``--hv.join-timeout`` is too tight a bound when a user or a test sets it short; it catches a hang."""

REUSEPORT_ENV = "LIBP2P_TCP_REUSEPORT"
"""Read by p2pd (go-libp2p's TCP transport); we set it to ``false`` unless the user set it.

Why: with reuseport, p2pd dials every connection from its listening port, so a connection made again after a
partition has the same addresses and ports as the dead one, whose other end may still be retrying it. On the
WAN lab that old end's late retransmission then reset the new connection 10-15 s after the link came back, in
the middle of a round ("Connection reset by peer", a partial round and one more re-sync). Reuseport only helps
NAT hole punching and port mapping, which the galaxy's DHT does not use (``nat_port_map``, relays and AutoNAT
are off below)."""


class GalaxyDHT(DHT):
    """hivemind.DHT whose process lives and dies as :mod:`open_diloco.galaxy.lifecycle` says."""

    def run(self) -> None:
        become_galaxy_child(self._parent_pid)
        logging.getLogger("hivemind.dht.dht").addFilter(_drop_requests_of_dead_callers)
        hold_tasks_in_loops_of(hivemind_dht)  # no request's task is garbage before it answers
        try:
            super().run()
        except EOFError:
            # The same dead caller, when unpickling its request fails with EOFError: hivemind catches only
            # OSError/RuntimeError there, so it escapes its loop. The DHT cannot serve on; exit without a
            # traceback.
            os._exit(1)


REBOOTSTRAP_SECONDS = 2.0
"""How often a node asks its initial peers again while some cluster looks gone (see :func:`rebootstrap`)."""
_REBOOTSTRAP_STEP_SECONDS = 3.0


def rebootstrap(
    dht: DHT, initial_peers: Sequence[str], silent_peers: Sequence[str] = (), live_peers: Sequence[str] = ()
) -> None:
    """Ping the initial peers and the silent clusters' peers again, and look up this node's neighbours, in the
    DHT's process; returns at once.

    Why: hivemind drops a peer from its routing table when it stops answering and asks the initial peers only
    once, at start. Across a partition each side's nodes drop every node of the other side and the bootstrap
    peer: when the link came back, neither side could find the other's records, and the two halves trained
    apart for good (seen on the WAN lab; docs/wan-lab.md). Pinging the initial peers puts them back in the
    routing table, and through them the other side. A peer that does not answer is disconnected (see
    :func:`_ping_or_drop`). A dead or unreachable peer costs a failed ping, in the background.

    ``silent_peers``: PeerIDs (base58) of clusters whose heartbeat stopped; their connection is the one that
    carries the rounds, so it gets the same treatment. ``live_peers``: PeerIDs of clusters whose heartbeat is
    fresh (an initial peer is often one): pinged, never disconnected, since a slow answer from a busy live
    peer must not cut the round it is in."""
    peer_ids = [Multiaddr(maddr)["p2p"] for maddr in initial_peers]
    peer_ids += [peer for peer in silent_peers if peer not in peer_ids]
    if peer_ids:
        keep = frozenset(live_peers)
        dht.run_coroutine(functools.partial(_ping_and_refresh, peer_ids, keep), return_future=True)


async def _ping_and_refresh(peer_ids: list[str], keep: frozenset[str], _dht: DHT, node) -> None:
    try:
        pings = [
            _ping_or_drop(node, PeerID.from_base58(peer), may_drop=peer not in keep) for peer in peer_ids
        ]
        await asyncio.gather(*pings, return_exceptions=True)
        await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), _REBOOTSTRAP_STEP_SECONDS)
    except Exception as err:  # unreachable for now: the next call tries again
        logging.getLogger(__name__).debug("re-bootstrap failed: %r", err)


async def answers_ping(node, peer: PeerID, seconds: float) -> bool:
    """Whether ``peer``'s DHT node answers a ping from ``node`` (in the DHT's process); raises
    ``asyncio.TimeoutError`` after ``seconds``."""
    return (
        await asyncio.wait_for(node.protocol.call_ping(peer, validate=False, strict=False), seconds)
        is not None
    )


def forget_finished_searches(dht: DHT) -> None:
    """Drop, in the DHT's process, the empty entries hivemind's ``DHTNode`` keeps for every key it ever looked
    up; returns at once.

    Why: ``DHTNode.pending_get_requests`` is a defaultdict that gains an entry (an empty ``SortedSet`` once
    the lookup ends) per key and never loses one, and every round's matchmaking key is new
    (:func:`~open_diloco.galaxy.round_wait.round_key_bits`). A cluster's DHT process grew ~1.5 KiB per round
    (~2 KiB per key) for as long as it ran: ~15 MiB per 10,000 rounds (``scripts/bench/memory_soak.py``,
    docs/results/memory-soak.md). An empty entry means nothing to hivemind (its lookups go through the
    defaultdict), so removing one changes no lookup."""
    with DHT_PIPE_LOCK:
        dht.run_coroutine(_forget_finished_searches, return_future=True)


async def _forget_finished_searches(_dht: DHT, node) -> int:
    finished = [key_id for key_id, searches in node.pending_get_requests.items() if not searches]
    for key_id in finished:
        del node.pending_get_requests[key_id]
    return len(finished)


_DROPPED: set[PeerID] = set()
"""Peers whose connections this DHT process closed and that have not answered a ping since (lives in the DHT's
process, where the coroutines below run)."""


async def _ping_or_drop(node, peer: PeerID, may_drop: bool = True) -> None:
    """Ping ``peer``; if it does not answer in time, close this daemon's connections to it, once until it
    answers again.

    Why: across a partition, TCP keeps the old connection and retransmits its unacknowledged bytes with a
    doubling timeout, so after 30 s without a link the next retry is ~28 s away (``ss -ti`` on the WAN lab:
    rto 28160 ms, backoff 7). Every request on that connection waits for it, and the two sides found each
    other again only 6-15 s after the link came back. A closed connection makes the next ping dial a new one,
    which gets through a round trip after the link is back (a dial in flight then: its next SYN, ≤ 4 s).
    Once only: a later failed ping is a failed dial, and closing again could cut a fresh connection the other
    side has just dialed, in the middle of a round (seen: "Connection reset by peer" in the first round
    back)."""
    try:
        answered = await answers_ping(node, peer, _REBOOTSTRAP_STEP_SECONDS)
    except asyncio.TimeoutError:
        answered = False
    if answered:
        _DROPPED.discard(peer)
    elif may_drop and peer not in _DROPPED:
        _DROPPED.add(peer)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.protocol.p2p._client.disconnect(peer), _REBOOTSTRAP_STEP_SECONDS)


def _drop_requests_of_dead_callers(record: logging.LogRecord) -> bool:
    """A request whose sender (the averager process) ended while the request sat in the DHT's pipe cannot be
    unpickled: hivemind logs that as an ERROR with a traceback, at every shutdown in the middle of
    matchmaking. Nothing is lost (the caller is gone), so it is dropped here; other errors pass."""
    error = record.exc_info[1] if record.exc_info else None
    return not (record.funcName == "_run" and isinstance(error, (OSError, EOFError)))


def start_dht(
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    join_timeout: float,
    client_mode: bool = False,
    identity_path: str | None = None,
) -> GalaxyDHT:
    """Start a DHT node that joins ``initial_peers`` (none: a new DHT), waiting at most ``join_timeout``.
    ``client_mode``: a node that only asks (``open-diloco status``); it stores nothing and serves no one.
    ``identity_path``: a libp2p private key file (made if missing): the node's PeerID, the same at every
    start.

    Bad addresses, unreachable peers and busy ports raise :class:`ConfigError` with a one-line fix."""
    for maddr in initial_peers:
        peer_address(maddr)
    _check_ports_free(host_maddrs)
    os.environ.setdefault(REUSEPORT_ENV, "false")  # inherited by the DHT's process and its p2pd
    dht = GalaxyDHT(
        initial_peers=list(initial_peers),
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        start=True,
        await_ready=False,
        client_mode=client_mode,
        nat_port_map=False,
        use_relay=False,
        use_auto_relay=False,
        auto_nat=False,
        wait_timeout=min(join_timeout, 3.0),
        shutdown_timeout=SHUTDOWN_SECONDS,
        **({"identity_path": identity_path} if identity_path else {}),
    )
    start_timeout = join_timeout if initial_peers else max(join_timeout, NEW_DHT_START_SECONDS)
    try:
        dht.wait_until_ready(timeout=start_timeout)
    except TimeoutError:
        shutdown_dht(dht)
        if not initial_peers:
            raise ConfigError(
                f"the new DHT node (no --hv.initial-peers) did not start within {start_timeout:.0f}s: its "
                "p2pd daemon hangs or the machine is overloaded; check `ps` for it and try again"
            ) from None
        raise ConfigError(
            f"could not join the DHT via --hv.initial-peers {list(initial_peers)} within "
            f"--hv.join-timeout={join_timeout}s; check that a peer runs there"
        ) from None
    except Exception as e:
        shutdown_dht(dht)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "already taken" in reason:
            raise ConfigError(
                f"the identity in {identity_path!r} is already online in this DHT: another process (or a "
                "previous run not yet gone) uses it; give every cluster its own --hv.identity-path, or wait "
                "for the old run to end"
            ) from None
        if "bootstrap" in reason:
            raise ConfigError(
                f"no DHT peer answered at --hv.initial-peers {list(initial_peers)}; start hivemind-dht "
                "there first or fix the address"
            ) from None
        raise ConfigError(
            f"could not start the DHT ({reason}); check --hv.initial-peers {list(initial_peers)} "
            f"and --hv.host-maddrs {list(host_maddrs)}"
        ) from None
    return dht


def _check_ports_free(host_maddrs: Sequence[str]) -> None:
    """p2pd reports a busy port only in its log; find out here and say which flag to change."""
    for maddr in host_maddrs:
        family, host, port = listen_address(maddr)
        if port == 0:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise ConfigError(
                        f"--hv.host-maddrs {maddr!r}: cannot listen there ({e.strerror})"
                    ) from None
                raise ConfigError(
                    f"--hv.host-maddrs {maddr!r}: port {port} is already in use; pick a free port or tcp/0"
                ) from None


def shutdown_dht(dht: DHT) -> None:
    """Shut the DHT down in order if it is healthy, then end whatever is left of its process tree (p2pd
    included) by PID. Bounded: a few seconds at most, whatever state the DHT is in."""
    if dht.is_alive() and dht._ready.done() and not dht._ready.exception():
        # hivemind's DHT.shutdown, minus its warning when the grace runs out: end_tree below does the rest
        with contextlib.suppress(OSError):
            dht._outer_pipe.send(("_shutdown", [], {}))
        dht.join(SHUTDOWN_SECONDS)
    end_child(dht)
