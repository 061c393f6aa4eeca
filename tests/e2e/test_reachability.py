"""The dial-back reachability check (galaxy/reachability.py) between real DHT nodes on 127.0.0.1: a node
learns within seconds whether another cluster can open a connection to each address it announces."""

from __future__ import annotations

import socket
import time

import pytest

from open_diloco.galaxy.dht import shutdown_dht, start_dht
from open_diloco.galaxy.reachability import check_reachability, serve_dial_back

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def first_cluster():
    """A DHT node that serves dial-backs, as every cluster's does; the DHT the others join."""
    dht = start_dht([], LOOPBACK, [], join_timeout=20)
    serve_dial_back(dht, admitted=None)
    yield dht
    shutdown_dht(dht)


def test_a_reachable_and_an_unreachable_announced_address_each_get_their_line(first_cluster):
    entry = [str(m) for m in first_cluster.get_visible_maddrs()]
    reachable = start_dht(entry, LOOPBACK, [], join_timeout=20)
    port = closed_port()
    unreachable = start_dht(entry, LOOPBACK, [f"/ip4/127.0.0.1/tcp/{port}"], join_timeout=20)
    try:
        started = time.monotonic()
        found = check_reachability(unreachable, seconds=20)
        assert time.monotonic() - started < 30
        assert found.reachable is False, found
        [line] = found.lines()
        assert line.startswith(f"not reachable at /ip4/127.0.0.1/tcp/{port}/p2p/"), line
        assert "--hv.announce-maddrs" in line and "--hv.client-mode" in line, line
        assert found.checked_by == str(first_cluster.peer_id)

        found = check_reachability(reachable, seconds=20)
        assert found.reachable is True, found
        assert all(line.startswith("reachable at /ip4/127.0.0.1/tcp/") for line in found.lines()), found
    finally:
        shutdown_dht(unreachable)
        shutdown_dht(reachable)


def test_the_first_cluster_says_it_could_not_be_checked_and_does_not_hang(first_cluster):
    started = time.monotonic()
    found = check_reachability(first_cluster, seconds=3)  # only itself: nobody to dial it back
    assert time.monotonic() - started < 10
    assert found.reachable is None
    assert found.lines()[0].startswith("reachability not checked: no other cluster answered within 3 s")


def test_a_cluster_off_the_allowlist_gets_no_dial_back(first_cluster):
    guarded = start_dht([str(m) for m in first_cluster.get_visible_maddrs()], LOOPBACK, [], join_timeout=20)
    asker = start_dht([str(m) for m in guarded.get_visible_maddrs()], LOOPBACK, [], join_timeout=20)
    serve_dial_back(guarded, admitted=frozenset({"12D3KooWSomeoneElse"}))
    try:
        # first_cluster answers anyone; with it gone, the guarded node alone must not answer
        shutdown_dht(first_cluster)
        found = check_reachability(asker, seconds=4)
        assert found.reachable is None, found
    finally:
        shutdown_dht(asker)
        shutdown_dht(guarded)
