"""Two hivemind peers talking through a libp2p circuit relay: what ``test_nat.py`` runs inside the WAN lab's
NATed namespaces to show how much a relay of hivemind's p2pd carries (docs/networks.md).

``python -m tests.wan.relay_probe serve RELAY``: a peer that holds a reservation on ``RELAY`` (a full
multiaddr) and echoes every blob sent to it; prints ``peer <PeerID>``, then serves until killed.
``python -m tests.wan.relay_probe send RELAY PEER SIZE [SIZE ...]``: connects to ``PEER`` through ``RELAY``
and sends it one blob of each size on one connection, printing one JSON line per blob (``size``, ``echoed``,
``error``), then exits.

The serving peer asks for its reservation the way a galaxy would have to: auto-relay with ``RELAY`` as its
only (static) relay and its reachability forced private. hivemind's ``use_relay_discovery`` is a no-op, and
with p2pd's relay discovery on, libp2p waits for 4 candidate relays or 3 minutes before it reserves (measured
3 min 0 s); p2pd's ``-relayDiscovery=0`` reaches it only through ``P2P.FORCE_REACHABILITY_MAPPING``. The
sender writes the circuit address's bytes itself: hivemind's ``Multiaddr`` encodes ``/p2p/<id>`` as a CID,
which the Go daemon rejects ("length greater than remaining number of bytes in buffer").
"""

from __future__ import annotations

import asyncio
import json
import sys

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

STATIC_RELAY = "private, static relay"
P2P.FORCE_REACHABILITY_MAPPING[STATIC_RELAY] = {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
LISTEN = ["/ip4/0.0.0.0/tcp/0"]


def circuit_address(relay: str) -> Multiaddr:
    """``<relay>/p2p-circuit``, with the relay's PeerID as a raw multihash (how Go's multiaddr writes it)."""
    base, _, relay_id = relay.rpartition("/p2p/")
    multihash = PeerID.from_base58(relay_id).to_bytes()
    p2p_code, circuit_code = bytes.fromhex("a503"), bytes.fromhex("a202")  # varints of 0x01a5 and 0x0122
    return Multiaddr(
        Multiaddr(base).to_bytes() + p2p_code + bytes([len(multihash)]) + multihash + circuit_code
    )


async def serve(relay: str) -> None:
    p2p = await P2P.create(
        initial_peers=[relay],
        host_maddrs=LISTEN,
        use_relay=True,
        use_auto_relay=True,
        trusted_relays=[relay],
        force_reachability=STATIC_RELAY,
    )

    async def echo(_info, reader, writer) -> None:
        try:
            await P2P.send_raw_data(await P2P.receive_raw_data(reader), writer)
        finally:
            writer.close()

    await p2p.add_binary_stream_handler("echo", echo)
    print(f"peer {p2p.peer_id}", flush=True)
    await asyncio.Event().wait()


async def send(relay: str, peer: str, sizes: list[int]) -> None:
    p2p = await P2P.create(initial_peers=[relay], host_maddrs=LISTEN, use_relay=True)
    target = PeerID.from_base58(peer)
    try:
        for size in sizes:
            result = {"size": size, "echoed": False, "error": ""}
            try:
                await asyncio.wait_for(p2p._client.connect(target, [circuit_address(relay)]), 15)
                _, reader, writer = await p2p.call_binary_stream_handler(target, "echo")
                await P2P.send_raw_data(b"x" * size, writer)
                result["echoed"] = len(await asyncio.wait_for(P2P.receive_raw_data(reader), 30)) == size
                writer.close()
            except Exception as err:
                result["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            print(json.dumps(result), flush=True)
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    role, relay, *rest = sys.argv[1:]
    asyncio.run(serve(relay) if role == "serve" else send(relay, rest[0], [int(s) for s in rest[1:]]))
