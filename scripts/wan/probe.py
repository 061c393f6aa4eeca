"""The lab's self-check, measured by the lab's own endpoints (run inside their namespaces).

    python -m scripts.wan.probe serve BIND_IP PORT          # echoes RTT probes, counts a UDP blast
    python -m scripts.wan.probe measure PEER_IP PORT MBIT   # prints {"rtt_ms": ..., "mbit": ...} as JSON

RTT: the median of 20 small UDP echoes, 20 ms apart. Rate: a UDP blast paced at 1.3x the expected rate for
2 s (UDP, because one TCP flow cannot fill a long lossy path: at 150 ms and 0.1 % loss the Mathis bound is
~20 Mbit/s, and that is TCP's limit, not the link's); the receiver's rate between its first and last packet,
in bytes on the wire (payload + UDP, IP and Ethernet headers, what tbf counts).
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time

PAYLOAD = 8900  # fits the lab's 9000-byte MTU
WIRE_OVERHEAD = 8 + 20 + 14


def serve(bind: str, port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    sock.bind((bind, port))
    first = last = None
    wire = 0
    print("ready", flush=True)
    while True:
        data, peer = sock.recvfrom(65536)
        kind = data[:1]
        if kind == b"E":
            sock.sendto(data, peer)
        elif kind == b"B":
            now = time.monotonic()
            if first is None:
                first = now
            else:
                wire += len(data) + WIRE_OVERHEAD  # the first packet opens the window, it is not counted
            last = now
        elif kind == b"Q":
            span = (last - first) if first is not None and last != first else 0.0
            sock.sendto(b"Q" + json.dumps({"wire_bytes": wire, "seconds": span}).encode(), peer)
            first = last = None
            wire = 0


def measure(peer: str, port: int, mbit: float, seconds: float = 2.0) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    rtts = []
    for seq in range(20):
        sent = time.monotonic()
        sock.sendto(b"E" + struct.pack("!Id", seq, sent), (peer, port))
        try:
            while True:
                data = sock.recv(64)
                if struct.unpack("!Id", data[1:13])[0] == seq:
                    rtts.append((time.monotonic() - sent) * 1e3)
                    break
        except TimeoutError:
            pass  # a lost probe
        time.sleep(0.02)
    # the blast: paced at 1.3x the expected rate, so the shaper, not the sender, sets the pace
    interval = (PAYLOAD + WIRE_OVERHEAD) * 8 / (1.3 * mbit * 1e6)
    payload = b"B" + bytes(PAYLOAD - 1)
    start = time.monotonic()
    next_send = start
    while (now := time.monotonic()) < start + seconds:
        if now < next_send:
            time.sleep(min(next_send - now, 0.001))
            continue
        try:
            sock.sendto(payload, (peer, port))
        except OSError:
            pass  # ENOBUFS: a full queue on the way drops it
        next_send += interval
        if now - next_send > 0.05:  # the sender fell behind: do not burst to catch up
            next_send = now
    time.sleep(0.5 + max(rtts, default=0) / 1e3)
    result = None
    for _ in range(5):  # the query itself may be lost
        sock.sendto(b"Q", (peer, port))
        try:
            data = sock.recv(4096)
            if data[:1] == b"Q":
                result = json.loads(data[1:])
                break
        except TimeoutError:
            continue
    got = result and result["seconds"] > 0
    return {
        "rtt_ms": statistics.median(rtts) if rtts else None,
        "rtt_probes": len(rtts),
        "mbit": result["wire_bytes"] * 8 / result["seconds"] / 1e6 if got else None,
    }


def main() -> None:
    cmd, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if cmd == "serve":
        serve(ip, port)
    else:
        print(json.dumps(measure(ip, port, float(sys.argv[4]))), flush=True)


if __name__ == "__main__":
    main()
