"""Multiaddr checks shared by the galaxy's start-up and the preflight: one parser, one wording, no
hivemind."""

from __future__ import annotations

import re
import socket

from open_diloco.errors import ConfigError

_MULTIADDR = re.compile(r"/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)(/.*)?")


def peer_address(maddr: str, flag: str = "--hv.initial-peers") -> tuple[str, int]:
    """Host and TCP port of a DHT peer's full multiaddr (``/ip4/10.0.0.1/tcp/31337/p2p/12D3KooW...``); an
    error names ``flag``, where it came from."""
    match = _MULTIADDR.fullmatch(maddr.strip())
    if match is None or not re.fullmatch(r"/p2p/\w+", match[4] or ""):
        raise ConfigError(
            f"{flag} {maddr!r} is not a full /ip4|ip6|dns/HOST/tcp/PORT/p2p/PEER_ID multiaddr; pass "
            "the line hivemind-dht prints, e.g. /ip4/10.0.0.1/tcp/31337/p2p/12D3KooW..."
        )
    return match[2], int(match[3])


def listen_address(maddr: str) -> tuple[socket.AddressFamily, str, int]:
    """Address family, host and TCP port of a ``--hv.host-maddrs`` entry (``/ip4/0.0.0.0/tcp/0``)."""
    match = _MULTIADDR.fullmatch(maddr.strip())
    if match is None or match[1] not in ("ip4", "ip6") or match[4]:
        raise ConfigError(
            f"--hv.host-maddrs {maddr!r} is not a valid listen multiaddr; e.g. /ip4/0.0.0.0/tcp/0"
        )
    family = socket.AF_INET6 if match[1] == "ip6" else socket.AF_INET
    return family, match[2], int(match[3])


def announce_address(maddr: str) -> tuple[str, int]:
    """Host and TCP port of a ``--hv.announce-maddrs`` entry: an address other clusters dial
    (``/ip4/203.0.113.7/tcp/31337``), so neither a wildcard host nor port 0, which only a listener may use."""
    match = _MULTIADDR.fullmatch(maddr.strip())
    if match is None or match[4] or match[2] in ("0.0.0.0", "::") or int(match[3]) == 0:
        raise ConfigError(
            f"--hv.announce-maddrs {maddr!r} is not an address others can dial; give this cluster's "
            "public /ip4|ip6|dns/HOST/tcp/PORT, e.g. /ip4/203.0.113.7/tcp/31337 (the port --hv.host-maddrs "
            "listens on)"
        )
    return match[2], int(match[3])
