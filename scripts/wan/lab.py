"""The WAN lab: clusters and a DHT in network namespaces of their own, joined through a bridge in another,
every link shaped to a profile of scripts/wan/profiles.toml.

    # builds, self-checks, holds until Ctrl+C:
    python -m scripts.wan.lab up --clusters 2 --profile intercontinental
    python -m scripts.wan.lab check --profile continent    # up, self-check, down; exit 1 if off
    python -m scripts.wan.lab down RUN_ID | --all          # remove a lab left behind / all of them
    ip netns exec odw-RUN_ID-c0 COMMAND                    # run something in cluster 0

Layout of a lab with run id R: namespace ``odw-R-br`` holds bridge ``br0``; each endpoint (``dht``, ``c0``,
``c1`` ...) has namespace ``odw-R-<endpoint>`` with a veth ``eth0`` to the bridge (no IP on it) and a TUN
``wan0`` holding its address (10.77.0.2 the DHT, 10.77.0.10+i cluster i). Rate: a tbf on ``eth0`` (the
endpoint's uplink) and on its peer in the bridge (its downlink). Delay, jitter and loss:
scripts/wan/forwarder.py between ``wan0`` and ``eth0``, one per endpoint. Only the lab's own namespaces are
touched, never the host's.

Cleanup: ``Lab`` is a context manager; the CLI removes its lab on exit, Ctrl+C or SIGTERM; the forwarders die
with the process that started them, and a reaper process (its own session) removes the namespaces when that
process is gone, even after SIGKILL. Every lab writes /run/open_diloco-wan/R.json for ``down``; finding
and removing a lab by run id is ``scripts/wan/namespaces.py``, the self-check ``scripts/wan/self_check.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from scripts.wan.namespaces import (
    PREFIX,
    RUNTIME,
    LabError,
    end_pids,
    lab_namespaces,
    reap,
    remove,
    require_root,
    run,
)
from scripts.wan.nat import INSIDE_SUFFIX, build_nat, ensure_nft, inside_address
from scripts.wan.profiles import Profile, load_profiles
from scripts.wan.self_check import format_check, self_check

MTU = 9000
# long fat paths need TCP windows beyond the defaults (per-namespace sysctls); no IPv6 chatter
NAMESPACE_SYSCTLS = [
    "net.ipv4.tcp_rmem=4096 131072 67108864",
    "net.ipv4.tcp_wmem=4096 65536 67108864",
    "net.ipv6.conf.all.disable_ipv6=1",
    "net.ipv6.conf.default.disable_ipv6=1",
]
REPO = Path(__file__).resolve().parents[2]


class Lab:
    """N clusters and a DHT in namespaces, each link shaped to ``profile``.
    ``with Lab(2, "continent") as lab:`` builds it and removes every namespace and process it made on exit."""

    def __init__(
        self,
        clusters: int,
        profile: str | Profile,
        run_id: str | None = None,
        python: str = sys.executable,
        nat: Sequence[str] = (),
        sysctls: Sequence[str] = (),
    ):
        profiles = load_profiles()
        if isinstance(profile, str):
            if profile not in profiles:
                raise LabError(
                    f"unknown profile {profile!r}: one of {', '.join(profiles)} (scripts/wan/profiles.toml)"
                )
            profile = profiles[profile]
        if clusters < 1:
            raise LabError("a lab needs at least one cluster")
        self.profile = profile
        self.clusters = clusters
        self.run_id = run_id or secrets.token_hex(3)
        self.python = python
        self.endpoints = ["dht", *(f"c{i}" for i in range(clusters))]
        self.nat = [self._endpoint(name) for name in nat]  # endpoints behind a NAT (scripts/wan/nat.py)
        if "dht" in self.nat:
            raise LabError("--nat: the DHT must be reachable (every cluster dials it); NAT clusters only")
        self.sysctls = [*NAMESPACE_SYSCTLS, *sysctls]
        """Set in every namespace: the lab's own, then ``sysctls`` (a host's TCP tuning, say:
        ``net.ipv4.tcp_slow_start_after_idle=0``); each namespace's TCP stack is its own."""
        self.forwarders: dict[str, subprocess.Popen] = {}
        self.reaper: subprocess.Popen | None = None
        self.workdir = RUNTIME / self.run_id

    # -- naming ------------------------------------------------------------------------------------------
    def _endpoint(self, name: str) -> str:
        """Accept ``dht``, ``c0`` or ``cluster0``."""
        name = name.replace("cluster", "c")
        if name not in self.endpoints:
            raise KeyError(f"no endpoint {name!r} in this lab ({', '.join(self.endpoints)})")
        return name

    def netns(self, endpoint: str) -> str:
        """The network namespace ``endpoint``'s processes run in (``dht``, ``c0``/``cluster0``, ...): behind
        its NAT when it has one."""
        name = self._endpoint(endpoint)
        return self._link_netns(name) + (INSIDE_SUFFIX if name in self.nat else "")

    def _link_netns(self, name: str) -> str:
        """The namespace holding ``name``'s public address and link (its NAT router when it has one)."""
        return f"{PREFIX}{self.run_id}-{name}"

    @property
    def bridge_netns(self) -> str:
        return f"{PREFIX}{self.run_id}-br"

    def address(self, endpoint: str) -> str:
        """The IPv4 address other endpoints reach ``endpoint`` at (a NAT's public address: nothing that starts
        outside gets through it)."""
        name = self._endpoint(endpoint)
        return "10.77.0.2" if name == "dht" else f"10.77.0.{10 + int(name[1:])}"

    def listen_address(self, endpoint: str) -> str:
        """The IPv4 address ``endpoint``'s processes listen on: its own, behind its NAT when it has one."""
        name = self._endpoint(endpoint)
        return inside_address(int(name[1:])) if name in self.nat else self.address(name)

    def _mac(self, endpoint: str) -> str:
        return f"02:0d:77:00:00:{int(self.address(endpoint).rsplit('.', 1)[1]):02x}"

    def exec_prefix(self, endpoint: str) -> list[str]:
        """Prefix a command with this to run it inside ``endpoint``'s namespace."""
        return ["ip", "netns", "exec", self.netns(endpoint)]

    def link_bytes(self, endpoint: str) -> tuple[int, int]:
        """(sent, received) bytes so far on ``endpoint``'s link (its ``eth0``, frames as the wire carries
        them: every process of the endpoint, headers and retransmissions included); a NATed endpoint's are its
        router's public link."""
        out = run("ip", "-n", self._link_netns(self._endpoint(endpoint)), "-j", "-s", "link", "show", "eth0")
        stats = json.loads(out.stdout)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def set_link(self, endpoint: str, up: bool) -> None:
        """Take ``endpoint``'s link down (a partition: nothing in or out) or bring it back up."""
        run("ip", "-n", self.bridge_netns, "link", "set", self._endpoint(endpoint), "up" if up else "down")

    # -- life cycle --------------------------------------------------------------------------------------
    def _state(self) -> None:
        pids = {
            proc.pid: psutil.Process(proc.pid).create_time()
            for proc in [*self.forwarders.values(), *([self.reaper] if self.reaper else [])]
        }
        state = {
            "run_id": self.run_id,
            "profile": self.profile.name,
            "lab_pid": os.getpid(),
            "namespaces": [
                self.bridge_netns,
                *map(self._link_netns, self.endpoints),
                *map(self.netns, self.nat),
            ],
            "pids": pids,
        }
        (RUNTIME / f"{self.run_id}.json").write_text(json.dumps(state))

    def up(self) -> Lab:
        """Build the lab; on any failure remove what was built and raise."""
        require_root()
        if self.nat:
            ensure_nft()
        RUNTIME.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._state()
        # the reaper removes the lab once this process is gone, whatever way it went
        self.reaper = subprocess.Popen(
            [self.python, "-m", "scripts.wan.lab", "_reap", self.run_id, str(os.getpid())],
            cwd=REPO,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(self.workdir / "reaper.log").open("w"),
        )
        self._state()
        try:
            self._build()
            self._start_forwarders()
        except BaseException:
            self.down()
            raise
        self._state()
        return self

    def _build(self) -> None:
        p = self.profile
        br = self.bridge_netns
        run("ip", "netns", "add", br)
        run("ip", "-n", br, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
        run("ip", "-n", br, "link", "set", "br0", "up")
        for name in self.endpoints:
            ns = self._link_netns(name)
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            veth = ("eth0", "netns", ns, "address", self._mac(name), "mtu", str(MTU), "type", "veth")
            run("ip", "link", "add", *veth, "peer", "name", name, "netns", br, "mtu", str(MTU))
            run("ip", "-n", br, "link", "set", name, "master", "br0", "up")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "tuntap", "add", "dev", "wan0", "mode", "tun")
            run("ip", "-n", ns, "link", "set", "wan0", "mtu", str(MTU), "txqueuelen", "2000", "up")
            run("ip", "-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "wan0")
            # uplink on the endpoint's side, downlink on the bridge's side of its veth
            run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", *self._tbf(p.up_mbit))
            run("tc", "-n", br, "qdisc", "add", "dev", name, "root", "tbf", *self._tbf(p.down_mbit))
            run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", *self.sysctls)
            if name in self.nat:
                build_nat(ns, self.netns(name), int(name[1:]), MTU, self.sysctls)

    @staticmethod
    def _tbf(mbit: float) -> list[str]:
        bytes_per_s = mbit * 1e6 / 8
        burst = int(max(4 * (MTU + 14), bytes_per_s * 0.001))  # 1 ms at the rate, at least 4 frames
        limit = int(max(4 * burst, bytes_per_s * 0.05))  # a 50 ms queue, as a router's buffer
        return ["rate", f"{int(mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]

    def _start_forwarders(self) -> None:
        p = self.profile
        macs = {self.address(n): self._mac(n) for n in self.endpoints}
        for i, name in enumerate(self.endpoints):
            ready = self.workdir / f"{name}.ready"
            ready.unlink(missing_ok=True)
            config = dict(
                delay_ms=p.delay_ms,
                jitter_ms=p.jitter_ms,
                loss_pct=p.loss_pct,
                macs=macs,
                seed=i,
                ready_file=str(ready),
                control_file=str(self.workdir / f"{name}.control"),
            )
            self.forwarders[name] = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self._link_netns(name),
                    self.python,
                    "-m",
                    "scripts.wan.forwarder",
                    json.dumps(config),
                ],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=(self.workdir / f"{name}.forwarder.log").open("w"),
            )
        deadline = time.monotonic() + 30
        for name, proc in self.forwarders.items():
            ready = self.workdir / f"{name}.ready"
            while not ready.exists():
                if proc.poll() is not None:
                    log = (self.workdir / f"{name}.forwarder.log").read_text().strip().splitlines()
                    raise LabError(f"the forwarder of {name} exited: {log[-1] if log else proc.returncode}")
                if time.monotonic() > deadline:
                    raise LabError(f"the forwarder of {name} did not start within 30 s")
                time.sleep(0.05)

    def down(self) -> None:
        """Remove every namespace and process of this lab (idempotent)."""
        procs = [*self.forwarders.values(), *([self.reaper] if self.reaper else [])]
        left = end_pids([proc.pid for proc in procs if proc.poll() is None])
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        remove(self.run_id)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if left:
            raise LabError(f"processes of the lab did not end: {left}")

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def leftovers(self) -> list[str]:
        """Namespaces of this lab that still exist (empty after down())."""
        return [ns for ns in lab_namespaces() if ns.startswith(f"{PREFIX}{self.run_id}-")]

    def check(self, port: int = 7777) -> dict:
        """The self-check (``scripts/wan/self_check.py``): RTT and rate against the profile, ``ok`` within ±10
        %."""
        return self_check(self, port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.wan.lab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, text in (
        ("up", "build a lab, self-check it, hold it until Ctrl+C/SIGTERM"),
        ("check", "build a lab, self-check it, remove it (exit 1 if off by more than 10 %%)"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--clusters", type=int, default=2)
        cmd.add_argument("--profile", default="intercontinental")
        cmd.add_argument("--run-id", help="names carry it (default: random)")
        cmd.add_argument("--nat", default="", help="clusters behind a NAT, comma-separated (e.g. c1,c2)")
        if name == "up":
            cmd.add_argument("--no-check", action="store_true", help="skip the self-check")
            cmd.add_argument("--ready-file", help="write the lab's JSON description here once it is up")
    down = sub.add_parser("down", help="remove a lab (by run id) or every lab (--all)")
    down.add_argument("run_id", nargs="?")
    down.add_argument("--all", action="store_true")
    sub.add_parser("profiles", help="list the profiles")
    reaper = sub.add_parser("_reap")
    reaper.add_argument("run_id")
    reaper.add_argument("pid", type=int)
    args = parser.parse_args(argv)

    try:
        if args.cmd == "profiles":
            for profile in load_profiles().values():
                print(profile.describe())
            return 0
        if args.cmd == "_reap":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            reap(args.run_id, args.pid)
            return 0
        require_root()
        if args.cmd == "down":
            if not args.all and not args.run_id:
                raise LabError("down needs a run id or --all")
            removed = remove(None if args.all else args.run_id)
            print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
            return 0
        return _up(args)
    except LabError as err:
        print(f"lab: error: {err}", file=sys.stderr)
        return 2


def _up(args) -> int:
    def stop(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    lab = Lab(args.clusters, args.profile, run_id=args.run_id, nat=[n for n in args.nat.split(",") if n])
    try:
        lab.up()
        print(f"lab {lab.run_id} up: {lab.profile.describe()}", flush=True)
        for name in lab.endpoints:
            behind = f" (behind a NAT, at {lab.listen_address(name)})" if name in lab.nat else ""
            print(
                f"  {name:>4}  {lab.address(name):<11} ip netns exec {lab.netns(name)} ...{behind}",
                flush=True,
            )
        figures = None
        if args.cmd == "check" or not args.no_check:
            figures = lab.check()
            print(format_check(figures), flush=True)
        if args.cmd == "check":
            return 0 if figures and figures["ok"] else 1
        if args.ready_file:
            desc = {
                "run_id": lab.run_id,
                "profile": lab.profile.name,
                "check": figures,
                "endpoints": {
                    n: {"netns": lab.netns(n), "address": lab.address(n), "listen": lab.listen_address(n)}
                    for n in lab.endpoints
                },
            }
            Path(args.ready_file).write_text(json.dumps(desc))
        print("holding the lab; Ctrl+C (or SIGTERM) removes it", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lab.down()
        print(f"lab {lab.run_id} removed", flush=True)


if __name__ == "__main__":
    sys.exit(main())
