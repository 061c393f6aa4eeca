r"""What libp2p itself carries over a WAN lab path, without the all-reduce: the transport hivemind's
all-reduce runs on, beside one plain TCP connection on the same path (issue 36: where a sync's seconds go).

    python -m scripts.bench.p2p_flow --profile intercontinental --repeats 2 --streams 1 2 4 --connections 2 4

Both ends send ``N`` bytes and receive ``N`` at once, as a 2-peer all-reduce does, over ``k`` hivemind P2P
streams (each carries N/k both ways) in 512 KiB ``AveragingData`` messages, the all-reduce's part size and
message type: Python, p2pd over its Unix socket, TLS, yamux and one TCP connection, the other p2pd, Python.
``--connections k``: k p2pd on each side, one connection and one stream each, each carrying N/k both ways (a
cluster of k ranks, each averaging its own shard over its own connection).
Nothing is reduced, so what this takes beyond the TCP flow (``scripts/bench/tcp_flow.py``, measured in the
same lab) is the transport's, and what the all-reduce takes beyond this is the all-reduce's. A stream ends
once the server has read all of its bytes, so the sender's seconds cover both directions. ``serve``/``send``
also run over p2pd's QUIC transport (``--transport quic``), which the galaxy does not use: a stream over it
loses its tail in about half the runs (the sender says so), and the lab is no yardstick for it
(docs/results/wan.md), so the bench leaves it out.

    python -m scripts.bench.p2p_flow serve --host 10.77.0.11 --bytes N --streams K   # prints its multiaddr
    python -m scripts.bench.p2p_flow send --maddr MADDR... --bytes N --streams K     # prints the seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING

import psutil

from scripts.bench import tcp_flow

if TYPE_CHECKING:
    from scripts.wan.lab import Lab

PART_BYTES = 512 << 10
"""hivemind's all-reduce part size (``DEFAULT_PART_SIZE_BYTES``), so each message is what a round sends."""
TIMEOUT_SECONDS = 600.0
HANDLER = "p2p_flow"
LISTEN = {"tcp": "/ip4/{host}/tcp/0", "quic": "/ip4/{host}/udp/0/quic-v1"}
"""p2pd's transports: the galaxy's (TCP, with TLS and yamux over it) and QUIC (its own streams and
congestion control), which p2pd also speaks."""


def _messages(nbytes: int) -> Iterator:
    from hivemind.proto import averaging_pb2, runtime_pb2

    blob, left = bytes(PART_BYTES), nbytes
    while left > 0:
        size = min(PART_BYTES, left)
        left -= size
        yield averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=blob[:size]))


async def _as_async(messages: Iterator) -> AsyncIterator:
    for message in messages:
        yield message


async def serve(
    host: str, nbytes: int, streams: int, one_way: bool = False, transport: str = "tcp", connections: int = 1
) -> None:
    """Serve ``connections`` P2P instances (a p2pd each, so one TCP connection each), each taking
    ``nbytes / connections`` over ``streams`` streams; prints their multiaddrs, one JSON line."""
    from hivemind.p2p import P2P
    from hivemind.proto import averaging_pb2

    share = nbytes // (connections * streams)

    async def handler(requests: AsyncIterator, _context) -> AsyncIterator:
        async def read_all() -> int:
            return sum([len(request.tensor_part.buffer) async for request in requests])

        reading = asyncio.create_task(read_all())  # both directions at once
        for message in _messages(0 if one_way else share):
            yield message
        if (got := await reading) != share:
            raise ConnectionError(f"a stream carried {got} bytes, not {share}")

    maddrs = []
    for _ in range(connections):
        p2p = await P2P.create(host_maddrs=[LISTEN[transport].format(host=host)])
        await p2p.add_protobuf_handler(
            HANDLER, handler, averaging_pb2.AveragingData, stream_input=True, stream_output=True
        )
        visible = str((await p2p.get_visible_maddrs())[0])  # (QUIC's come with the id already)
        maddrs.append(f"{visible.split('/p2p/')[0]}/p2p/{p2p.peer_id.to_base58()}")
    print(json.dumps({"maddrs": maddrs}), flush=True)
    await asyncio.sleep(TIMEOUT_SECONDS)  # until the bench ends this process by PID


async def send(
    maddrs: list[str], nbytes: int, streams: int, one_way: bool = False, transport: str = "tcp"
) -> None:
    """Dial each of ``maddrs`` from a P2P instance of its own (one connection each) and exchange
    ``nbytes / len(maddrs)`` over ``streams`` streams of each, all at once; prints the seconds."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2

    peers = [PeerID.from_base58(maddr.split("/p2p/")[1]) for maddr in maddrs]
    share = nbytes // (len(maddrs) * streams)

    async def one_stream(p2p: P2P, peer: PeerID) -> int:
        requests = _as_async(_messages(share))
        replies = await p2p.iterate_protobuf_handler(peer, HANDLER, requests, averaging_pb2.AveragingData)
        return sum([len(reply.tensor_part.buffer) async for reply in replies])

    p2ps, listen = [], LISTEN[transport].format(host="0.0.0.0")
    try:
        for maddr in maddrs:  # dials the servers: the connections exist before the clock starts
            p2ps.append(await P2P.create(initial_peers=[maddr], host_maddrs=[listen]))
        daemons = [child.pid for child in psutil.Process().children()]  # reported: a caller checks them gone
        start = time.monotonic()
        flows = [one_stream(p2p, peer) for p2p, peer in zip(p2ps, peers, strict=True) for _ in range(streams)]
        got = await asyncio.wait_for(asyncio.gather(*flows), TIMEOUT_SECONDS)
        seconds = time.monotonic() - start
        if sum(got) != (0 if one_way else len(flows) * share):
            raise ConnectionError(f"received {sum(got)} bytes, not {0 if one_way else len(flows) * share}")
        figures = {"seconds": seconds, "bytes": sum(got), "streams": streams, "connections": len(maddrs)}
        print(json.dumps({**figures, "daemons": daemons}), flush=True)
    finally:
        for p2p in p2ps:
            await p2p.shutdown()


def measure(
    lab: Lab,
    nbytes: int,
    repeats: int,
    streams: int,
    one_way: bool = False,
    transport: str = "tcp",
    connections: int = 1,
) -> list[float]:
    """Seconds of ``repeats`` duplex transfers of ``nbytes`` each way (``one_way``: from cluster 0 only) over
    ``streams`` libp2p streams on each of ``connections`` connections between clusters 0 and 1 of ``lab``, one
    after another. Every process is ended by PID before this returns. ``transport``: a key of
    :data:`LISTEN`."""
    size = ["--bytes", str(nbytes), "--streams", str(streams), "--transport", transport]
    size += ["--one-way"] if one_way else []
    serve_args = ["--host", lab.address("c1"), "--connections", str(connections), *size]
    return tcp_flow.timed_exchanges(
        lab,
        "scripts.bench.p2p_flow",
        serve_args,
        lambda ready: ["--maddr", *ready["maddrs"], *size],
        repeats,
        server_exits=False,  # it serves until ended by PID
    )


def compare(
    profile: str,
    nbytes: int,
    repeats: int,
    stream_counts: list[int],
    sysctls: list[str],
    connection_counts: Sequence[int] = (),
) -> list[str]:
    """A markdown table: the TCP flow, each stream count, one stream one way (each direction of a duplex TCP
    flow has its own link, so it compares), and each count of connections (one stream each, as a cluster of
    that many ranks averages its shards), in one lab of ``profile`` (``sysctls`` set in its namespaces), with
    ÷ TCP."""
    from scripts.wan.lab import Lab

    with Lab(2, profile, sysctls=sysctls) as lab:
        tcp = tcp_flow.measure(lab, nbytes, repeats)
        rows = [("one TCP connection", tcp)]
        rows += [(f"libp2p, {k} stream(s)", measure(lab, nbytes, repeats, k)) for k in stream_counts]
        rows.append(("libp2p, 1 stream, one way", measure(lab, nbytes, repeats, 1, one_way=True)))
        rows += [
            (f"libp2p, {k} connections", measure(lab, nbytes, repeats, 1, connections=k))
            for k in connection_counts
        ]
    baseline = statistics.median(tcp)
    lines = [
        f"{nbytes / 1e6:.0f} MB each way, {profile}, {repeats} run(s) each, sysctls: {sysctls or 'none'}",
        "",
        "| flow | seconds | median | ÷ TCP |",
        "| --- | --- | --- | --- |",
    ]
    for name, seconds in rows:
        median = statistics.median(seconds)
        runs = ", ".join(f"{s:.2f}" for s in seconds)
        lines.append(f"| {name} | {runs} | {median:.2f} | {median / baseline:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", nargs="?", choices=["serve", "send"], help="one end (the bench runs both)")
    parser.add_argument("--host", help="serve: the address to listen on")
    parser.add_argument("--maddr", nargs="+", help="send: the server's multiaddrs, as it printed them")
    parser.add_argument("--bytes", type=int, default=105_000_000, help="bytes each way (a 25M fp32 round)")
    parser.add_argument(
        "--streams", type=int, nargs="+", default=[1], help="streams (several: one case each)"
    )
    parser.add_argument(
        "--connections",
        type=int,
        nargs="+",
        default=[],
        help="connections (a p2pd each, one stream each; several: one case each): serve: how many",
    )
    parser.add_argument("--one-way", action="store_true", help="serve/send: the server sends nothing back")
    parser.add_argument(
        "--transport", choices=sorted(LISTEN), default="tcp", help="serve/send: p2pd's transport"
    )
    parser.add_argument("--profile", default="intercontinental", help="the bench: the lab's profile")
    parser.add_argument("--repeats", type=int, default=2, help="the bench: runs of each case")
    parser.add_argument(
        "--sysctls", nargs="*", default=[], help="the bench: set in every lab namespace (name=value)"
    )
    args = parser.parse_args(argv)
    if args.role == "serve":
        connections = args.connections[0] if args.connections else 1
        asyncio.run(serve(args.host, args.bytes, args.streams[0], args.one_way, args.transport, connections))
    elif args.role == "send":
        asyncio.run(send(args.maddr, args.bytes, args.streams[0], args.one_way, args.transport))
    else:
        lines = compare(args.profile, args.bytes, args.repeats, args.streams, args.sysctls, args.connections)
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
