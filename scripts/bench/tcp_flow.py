r"""What one TCP connection carries over a WAN lab path: the ceiling any all-reduce that runs over a single
connection per pair (hivemind's, ours) can reach, measured beside the galaxy in the same lab and run
(scripts/bench/wan.py's ``tcp s`` column).

    python -m scripts.bench.tcp_flow serve --host 10.77.0.11 --port 7788 --bytes N  # in cluster 1
    python -m scripts.bench.tcp_flow send --host 10.77.0.11 --port 7788 --bytes N   # in cluster 0

Both ends send ``N`` bytes and receive ``N`` at once over one connection, as a 2-peer all-reduce does (each
sends its half of the Δ and the average of the other half back): the sender prints the seconds until both
directions are done, as JSON. Plain kernel TCP with the namespace's settings (congestion control, buffers):
no libp2p, no Python in the data path beyond ``sendall``/``recv_into`` of 4 MiB chunks."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from open_diloco.local_galaxy import kill_tree

if TYPE_CHECKING:
    from scripts.wan.lab import Lab

REPO = Path(__file__).resolve().parents[2]

CHUNK = 4 << 20
TIMEOUT_SECONDS = 600.0


def _duplex(conn: socket.socket, nbytes: int) -> None:
    """Send ``nbytes`` and receive ``nbytes`` on ``conn`` at the same time; raise if the peer stops early."""
    errors: list[BaseException] = []

    def send() -> None:
        try:
            block, left = bytes(CHUNK), nbytes
            while left > 0:
                conn.sendall(block[: min(CHUNK, left)])
                left -= min(CHUNK, left)
        except BaseException as err:  # handed to the caller's thread
            errors.append(err)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    buffer, left = bytearray(CHUNK), nbytes
    while left > 0:
        got = conn.recv_into(buffer, min(CHUNK, left))
        if got == 0:
            raise ConnectionError(f"the peer closed with {left} bytes still to come")
        left -= got
    sender.join(TIMEOUT_SECONDS)
    if errors or sender.is_alive():
        raise ConnectionError(f"sending did not finish: {errors or 'timed out'}")


def serve(host: str, port: int, nbytes: int) -> None:
    with socket.create_server((host, port)) as server:
        server.settimeout(TIMEOUT_SECONDS)
        print(json.dumps({"listening": server.getsockname()[1]}), flush=True)  # (port 0: the OS's pick)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(TIMEOUT_SECONDS)
            _duplex(conn, nbytes)
            conn.recv(1)  # the sender's close: both directions are through


def send(host: str, port: int, nbytes: int) -> None:
    with socket.create_connection((host, port), timeout=TIMEOUT_SECONDS) as conn:
        start = time.monotonic()
        _duplex(conn, nbytes)
        print(json.dumps({"seconds": time.monotonic() - start, "bytes": nbytes}), flush=True)


def measure(lab: Lab, nbytes: int, repeats: int, port: int = 7788) -> list[float]:
    """Seconds of ``repeats`` duplex transfers of ``nbytes`` each way between clusters 0 and 1 of ``lab``,
    one connection each, one after another. Every process is ended by PID before this returns."""
    where = ["--host", lab.address("c1"), "--port", str(port), "--bytes", str(nbytes)]
    return timed_exchanges(
        lab, "scripts.bench.tcp_flow", where, lambda _ready: where, repeats, server_exits=True
    )


def timed_exchanges(
    lab: Lab,
    module: str,
    serve_args: list[str],
    send_args: Callable[[dict], list[str]],
    repeats: int,
    server_exits: bool,
) -> list[float]:
    """Seconds of ``repeats`` exchanges between ``python -m module serve`` in cluster 1 of ``lab`` and
    ``... send`` in cluster 0, one after another (this bench's and scripts/bench/p2p_flow.py's).
    ``send_args`` gives the sender's arguments from the server's first line (JSON: where it listens); the
    sender's last line holds ``seconds``. ``server_exits``: the server ends on its own after one exchange and
    is waited for. Every process is ended by PID before this returns."""
    seconds = []
    role = [sys.executable, "-m", module]
    for _ in range(repeats):
        server = subprocess.Popen(
            [*lab.exec_prefix("c1"), *role, "serve", *serve_args], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        try:
            ready = json.loads(server.stdout.readline())
            out = subprocess.run(
                [*lab.exec_prefix("c0"), *role, "send", *send_args(ready)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_SECONDS,
                check=True,
            ).stdout
            seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
            if server_exits:
                server.wait(timeout=30)
        finally:
            kill_tree(server.pid)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", choices=["serve", "send"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args(argv)
    (serve if args.role == "serve" else send)(args.host, args.port, args.bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
