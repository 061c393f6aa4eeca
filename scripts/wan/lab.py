"""The WAN lab: clusters and a DHT in network namespaces of their own, joined through a bridge in another,
every link shaped to a profile of scripts/wan/profiles.toml.

    python -m scripts.wan.lab up --clusters 2 --profile intercontinental   # builds, self-checks, holds until Ctrl+C
    python -m scripts.wan.lab check --profile continent                     # up, self-check, down; exit 1 if off
    python -m scripts.wan.lab down RUN_ID | --all                           # remove a lab left behind / all of them
    ip netns exec odw-RUN_ID-c0 COMMAND                                     # run something in cluster 0

Layout of a lab with run id R: namespace ``odw-R-br`` holds bridge ``br0``; each endpoint (``dht``, ``c0``,
``c1`` ...) has namespace ``odw-R-<endpoint>`` with a veth ``eth0`` to the bridge (no IP on it) and a TUN
``wan0`` holding its address (10.77.0.2 the DHT, 10.77.0.10+i cluster i). Rate: a tbf on ``eth0`` (the
endpoint's uplink) and on its peer in the bridge (its downlink). Delay, jitter and loss: scripts/wan/forwarder.py
between ``wan0`` and ``eth0``, one per endpoint. Only the lab's own namespaces are touched, never the host's.

Cleanup: ``Lab`` is a context manager; the CLI removes its lab on exit, Ctrl+C or SIGTERM; the forwarders die
with the process that started them, and a reaper process (its own session) removes the namespaces when that
process is gone, even after SIGKILL. Every lab writes /run/open_diloco-wan/R.json for ``down``.
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
from pathlib import Path

import psutil

from scripts.wan.profiles import Profile, load_profiles

PREFIX = "odw-"
RUNTIME = Path("/run/open_diloco-wan")
MTU = 9000
REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.10


class LabError(RuntimeError):
    """A lab that cannot be built here; the CLI prints it as one line and exits 2."""


def _run(*cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def require_root() -> None:
    """Raise LabError unless this process may build namespaces (root) and iproute2 is here."""
    if os.geteuid() != 0:
        raise LabError("the WAN lab needs root (network namespaces, tc): run it as root, e.g. with sudo")
    missing = [tool for tool in ("ip", "tc") if not shutil.which(tool)]
    if missing:
        raise LabError(f"the WAN lab needs iproute2 ({', '.join(missing)} missing): apt-get install iproute2")


def _end_pids(pids: list[int], grace: float = 3.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace``; returns what is still alive (normally nothing)."""
    from open_diloco.processes import signal_pids, wait_gone

    signal_pids(pids, signal.SIGTERM)
    left = wait_gone(pids, grace)
    signal_pids(left, signal.SIGKILL)
    return wait_gone(left, 5.0)


def _netns_pids(ns: str) -> list[int]:
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def lab_namespaces() -> list[str]:
    """Every network namespace any lab made (by name prefix)."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def remove(run_id: str | None) -> list[str]:
    """Remove lab ``run_id`` (None: every lab): end the processes in its namespaces and the ones it recorded,
    by PID, then delete the namespaces. Returns the namespaces removed."""
    states = sorted(RUNTIME.glob(f"{run_id}.json" if run_id else "*.json"))
    pids: list[int] = []
    for state in states:
        with contextlib.suppress(OSError, ValueError):
            recorded = json.loads(state.read_text())
            for pid, started in recorded.get("pids", {}).items():
                with contextlib.suppress(psutil.Error):
                    if abs(psutil.Process(int(pid)).create_time() - started) < 1 and int(pid) != os.getpid():
                        pids.append(int(pid))
    namespaces = [ns for ns in lab_namespaces() if run_id is None or ns.startswith(f"{PREFIX}{run_id}-")]
    for ns in namespaces:
        pids += _netns_pids(ns)
    left = _end_pids(sorted(set(pids)))
    if left:
        raise LabError(f"processes of the lab did not end: {left}")
    for ns in namespaces:
        _run("ip", "netns", "delete", ns, check=False)
    for state in states:
        state.unlink(missing_ok=True)
        shutil.rmtree(state.with_suffix(""), ignore_errors=True)
    if run_id is None:  # workdirs of labs that never wrote a state
        for leftover in RUNTIME.glob("*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return namespaces


class Lab:
    """N clusters and a DHT in namespaces, each link shaped to ``profile``. ``with Lab(2, "continent") as lab:``
    builds it and removes every namespace and process it made on exit."""

    def __init__(
        self, clusters: int, profile: str | Profile, run_id: str | None = None, python: str = sys.executable
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
        """The network namespace of ``endpoint`` (``dht``, ``c0``/``cluster0``, ...)."""
        return f"{PREFIX}{self.run_id}-{self._endpoint(endpoint)}"

    @property
    def bridge_netns(self) -> str:
        return f"{PREFIX}{self.run_id}-br"

    def address(self, endpoint: str) -> str:
        """The IPv4 address other endpoints reach ``endpoint`` at."""
        name = self._endpoint(endpoint)
        return "10.77.0.2" if name == "dht" else f"10.77.0.{10 + int(name[1:])}"

    def _mac(self, endpoint: str) -> str:
        return f"02:0d:77:00:00:{int(self.address(endpoint).rsplit('.', 1)[1]):02x}"

    def exec_prefix(self, endpoint: str) -> list[str]:
        """Prefix a command with this to run it inside ``endpoint``'s namespace."""
        return ["ip", "netns", "exec", self.netns(endpoint)]

    def set_link(self, endpoint: str, up: bool) -> None:
        """Take ``endpoint``'s link down (a partition: nothing in or out) or bring it back up."""
        _run("ip", "-n", self.bridge_netns, "link", "set", self._endpoint(endpoint), "up" if up else "down")

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
            "namespaces": [self.bridge_netns, *map(self.netns, self.endpoints)],
            "pids": pids,
        }
        (RUNTIME / f"{self.run_id}.json").write_text(json.dumps(state))

    def up(self) -> Lab:
        """Build the lab; on any failure remove what was built and raise."""
        require_root()
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
        _run("ip", "netns", "add", br)
        _run("ip", "-n", br, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for name in self.endpoints:
            ns = self.netns(name)
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "address",
                self._mac(name),
                "mtu",
                str(MTU),
                "type",
                "veth",
                "peer",
                "name",
                name,
                "netns",
                br,
                "mtu",
                str(MTU),
            )
            _run("ip", "-n", br, "link", "set", name, "master", "br0", "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "tuntap", "add", "dev", "wan0", "mode", "tun")
            _run("ip", "-n", ns, "link", "set", "wan0", "mtu", str(MTU), "txqueuelen", "2000", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "wan0")
            # uplink on the endpoint's side, downlink on the bridge's side of its veth
            _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", *self._tbf(p.up_mbit))
            _run("tc", "-n", br, "qdisc", "add", "dev", name, "root", "tbf", *self._tbf(p.down_mbit))
            # long fat paths need TCP windows beyond the defaults (per-namespace sysctls); no IPv6 chatter
            _run(
                "ip",
                "netns",
                "exec",
                ns,
                "sysctl",
                "-q",
                "-w",
                "net.ipv4.tcp_rmem=4096 131072 67108864",
                "net.ipv4.tcp_wmem=4096 65536 67108864",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            )

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
                [*self.exec_prefix(name), self.python, "-m", "scripts.wan.forwarder", json.dumps(config)],
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
        left = _end_pids([proc.pid for proc in procs if proc.poll() is None])
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

    # -- self-check --------------------------------------------------------------------------------------
    def check(self, port: int = 7777) -> dict:
        """Measure RTT and rate from the first cluster to the second (or the DHT) and compare with the profile.
        Returns the figures and ``ok`` (both within ±10 %)."""
        src, dst = "c0", ("c1" if self.clusters > 1 else "dht")
        server = subprocess.Popen(
            [
                *self.exec_prefix(dst),
                self.python,
                "-m",
                "scripts.wan.probe",
                "serve",
                self.address(dst),
                str(port),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()  # "ready" (the probe prints nothing else before)
            if "ready" not in line:
                raise LabError(f"the self-check server did not start: {line.strip()}")
            rate = self.profile.path_mbit()
            out = _run(
                *self.exec_prefix(src),
                self.python,
                "-m",
                "scripts.wan.probe",
                "measure",
                self.address(dst),
                str(port),
                str(rate),
                timeout=60,
            ).stdout
        finally:
            _end_pids([server.pid])
            server.wait(timeout=5)
        got = json.loads(out.strip().splitlines()[-1])
        figures = {
            "profile": self.profile.name,
            "path": f"{src} -> {dst}",
            "rtt_ms": got["rtt_ms"],
            "rtt_expected_ms": self.profile.rtt_ms,
            "mbit": got["mbit"],
            "mbit_expected": rate,
        }
        figures["rtt_ok"] = (
            got["rtt_ms"] is not None and abs(got["rtt_ms"] / self.profile.rtt_ms - 1) <= TOLERANCE
        )
        figures["rate_ok"] = got["mbit"] is not None and abs(got["mbit"] / rate - 1) <= TOLERANCE
        figures["ok"] = figures["rtt_ok"] and figures["rate_ok"]
        return figures


def format_check(fig: dict) -> str:
    def fmt(value, unit):
        return "none" if value is None else f"{value:.4g} {unit}"

    verdict = "ok" if fig["ok"] else "OFF by more than ±10 %"
    return (
        f"self-check {fig['profile']} ({fig['path']}): RTT {fmt(fig['rtt_ms'], 'ms')} (profile "
        f"{fig['rtt_expected_ms']:g} ms), rate {fmt(fig['mbit'], 'Mbit/s')} (profile {fig['mbit_expected']:g}"
        f" Mbit/s): {verdict}"
    )


def _reap(run_id: str, pid: int) -> None:
    """Wait for process ``pid`` (the lab's owner) to end, then remove lab ``run_id``."""
    with contextlib.suppress(psutil.Error):
        owner = psutil.Process(pid)
        while owner.is_running() and owner.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.5)
    remove(run_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.wan.lab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, text in (
        ("up", "build a lab, self-check it, hold it until Ctrl+C/SIGTERM"),
        ("check", "build a lab, self-check it, remove it (exit 1 if off by more than 10 %)"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--clusters", type=int, default=2)
        cmd.add_argument("--profile", default="intercontinental")
        cmd.add_argument("--run-id", help="names carry it (default: random)")
        if name == "up":
            cmd.add_argument("--no-check", action="store_true", help="skip the self-check")
            cmd.add_argument("--ready-file", help="write the lab's JSON description here once it is up")
    down = sub.add_parser("down", help="remove a lab (by run id) or every lab (--all)")
    down.add_argument("run_id", nargs="?")
    down.add_argument("--all", action="store_true")
    sub.add_parser("profiles", help="list the profiles")
    reap = sub.add_parser("_reap")
    reap.add_argument("run_id")
    reap.add_argument("pid", type=int)
    args = parser.parse_args(argv)

    try:
        if args.cmd == "profiles":
            for profile in load_profiles().values():
                print(profile.describe())
            return 0
        if args.cmd == "_reap":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _reap(args.run_id, args.pid)
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
    lab = Lab(args.clusters, args.profile, run_id=args.run_id)
    try:
        lab.up()
        print(f"lab {lab.run_id} up: {lab.profile.describe()}", flush=True)
        for name in lab.endpoints:
            print(f"  {name:>4}  {lab.address(name):<11} ip netns exec {lab.netns(name)} ...", flush=True)
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
                "endpoints": {n: {"netns": lab.netns(n), "address": lab.address(n)} for n in lab.endpoints},
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
