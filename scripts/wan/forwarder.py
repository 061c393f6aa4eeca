"""The user-space half of a lab link: one-way delay, jitter and loss (this kernel has no netem).

Runs inside one endpoint's network namespace (``ip netns exec NS python -m scripts.wan.forwarder CONFIG``).
The endpoint's IP address lives on a TUN device (``wan0``); its veth to the lab's bridge (``eth0``) carries no
IP at all. Every IP packet the endpoint sends comes out of the TUN, waits here for its release time (half the
profile's one-way delay, plus jitter), may be dropped (the profile's loss), and leaves on ``eth0`` inside an
Ethernet frame of a private EtherType addressed to the destination endpoint's MAC (a static table: the lab
sets every MAC). The receiving endpoint's forwarder takes such frames off its ``eth0``, holds them the other
half of the delay and writes them into its TUN. The kernel has no handler for that EtherType, so it never
delivers a frame itself; rate limits are tbf qdiscs on the veths, outside this process.

Packet order is kept in each direction (a packet's release time is never before its predecessor's), as on a
real path without reordering. On SIGTERM it prints its counters to stderr and exits.

Loss can change while it runs: ``control_file`` (scripts/wan/control.py writes it) holds ``{"loss_pct": X,
"loss_in_pct": Y}`` for packets sent and received; without the file, the profile's loss one way. A burst of
loss is a fault the chaos soak injects, and restarting a forwarder to change it would cut every connection
through it.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

ETHERTYPE = 0x88B5  # IEEE "local experimental": no kernel handler
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PACKET_OUTGOING = 4
PR_SET_PDEATHSIG = 1
BATCH = 256


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def open_link(ifname: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETHERTYPE))
    sock.bind((ifname, ETHERTYPE))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setblocking(False)
    return sock


class Stop(BaseException):
    pass


class LossControl:
    """The loss of each direction, read again from ``path`` whenever it changes (polled, cheap: one stat every
    0.2 s); no file: ``loss`` outbound and none inbound, the profile's figures."""

    def __init__(self, path: str | None, loss: float):
        self.path, self.base = path, loss
        self.out, self.into = loss, 0.0
        self._seen: int | None = None
        self._next = 0.0

    def poll(self, now: float) -> None:
        if not self.path or now < self._next:
            return
        self._next = now + 0.2
        try:
            seen = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            seen = None
        if seen == self._seen:
            return
        self._seen = seen
        values = {}
        if seen is not None:
            try:
                with open(self.path) as f:
                    values = json.load(f)
            except (OSError, ValueError):  # replaced under us: read it again at the next poll
                self._seen = None
                return
        self.out = values.get("loss_pct", self.base * 100) / 100
        self.into = values.get("loss_in_pct", 0.0) / 100
        print(f"loss now {self.out:.2%} out, {self.into:.2%} in", file=sys.stderr, flush=True)


def run(config: dict) -> dict:
    """Forward until SIGTERM; return the counters."""
    delay_out = config["delay_ms"] / 2e3
    delay_in = config["delay_ms"] / 2e3
    jitter = config.get("jitter_ms", 0.0) / 1e3
    control = LossControl(config.get("control_file"), config.get("loss_pct", 0.0) / 100)
    macs = {socket.inet_aton(ip): bytes.fromhex(mac.replace(":", "")) for ip, mac in config["macs"].items()}
    ifname = config.get("link", "eth0")
    rng = random.Random(config.get("seed"))
    tun = open_tun(config.get("tun", "wan0"))
    link = open_link(ifname)
    outq: collections.deque = collections.deque()  # (release, packet, mac)
    inq: collections.deque = collections.deque()  # (release, packet)
    stats = dict(sent=0, received=0, lost=0, lost_in=0, unroutable=0, queue_full=0, max_held=0)
    last_out = 0.0

    def stop(*_):
        raise Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if ready := config.get("ready_file"):
        with open(ready, "w") as f:
            f.write(str(os.getpid()))
    try:
        while True:
            now = time.monotonic()
            control.poll(now)
            while outq and outq[0][0] <= now:
                _, packet, mac = outq.popleft()
                try:
                    link.sendto(packet, (ifname, ETHERTYPE, 0, 0, mac))
                    stats["sent"] += 1
                except (BlockingIOError, OSError):  # the tbf queue is full: a router would drop it too
                    stats["queue_full"] += 1
            while inq and inq[0][0] <= now:
                os.write(tun, inq.popleft()[1])
                stats["received"] += 1
            stats["max_held"] = max(stats["max_held"], len(outq) + len(inq))
            heads = [q[0][0] for q in (outq, inq) if q]
            timeout = max(0.0, min(heads) - now) if heads else 1.0
            readable, _, _ = select.select([tun, link], [], [], timeout)
            now = time.monotonic()
            if tun in readable:
                for _ in range(BATCH):
                    try:
                        packet = os.read(tun, 65536)
                    except BlockingIOError:
                        break
                    mac = macs.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
                    if mac is None:
                        stats["unroutable"] += 1
                        continue
                    if control.out and rng.random() < control.out:
                        stats["lost"] += 1
                        continue
                    release = now + delay_out + (rng.uniform(-jitter, jitter) if jitter else 0.0)
                    last_out = max(last_out, release)
                    outq.append((last_out, packet, mac))
            if link in readable:
                for _ in range(BATCH):
                    try:
                        packet, addr = link.recvfrom(65536)
                    except BlockingIOError:
                        break
                    if addr[2] == PACKET_OUTGOING:
                        continue
                    if control.into and rng.random() < control.into:
                        stats["lost_in"] += 1
                        continue
                    inq.append((now + delay_in, packet))
    except Stop:
        pass
    return stats


def main() -> None:
    config = json.loads(sys.argv[1])
    # end with the lab process that started us, even if it is killed (its reaper then removes the namespaces)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    stats = run(config)
    print(json.dumps(stats), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
