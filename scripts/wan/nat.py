"""A NAT in front of a WAN-lab endpoint: the endpoint's processes run in a namespace behind a router that
masquerades what they send and drops every connection that starts outside, as a university's or a cloud VPC's
NAT does.

Layout for endpoint ``c1`` of lab R: the namespace ``odw-R-c1`` (the lab's, with ``wan0`` at the public
address 10.77.0.11 and the link's forwarder) becomes the router; the cluster runs in ``odw-R-c1-in``, at
10.78.<i>.2 behind a veth ``lan0`` whose router side is 10.78.<i>.1. The router forwards what comes from
inside, masquerades it to 10.77.0.11, lets replies back in by connection tracking, and drops the rest: a peer
that dials 10.77.0.11 (or 10.78.<i>.2, which is routed nowhere) waits out its timeout, as on the real
internet. The rules are nftables (Debian's ``nftables`` package; this kernel has NAT built in):
:func:`ensure_nft` installs it when it is missing.
"""

from __future__ import annotations

import shutil
import subprocess

from scripts.wan.namespaces import LabError, run

INSIDE_SUFFIX = "-in"

RULES = """
table ip odw_nat {
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" masquerade
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        iifname "lan0" accept
        ct state established,related accept
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state new drop
    }
}
"""


def ensure_nft() -> None:
    """``nft`` on PATH, installed from Debian's packages when missing (root); LabError with the command to run
    when that fails."""
    if shutil.which("nft"):
        return
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    # a fresh image may have no package lists yet: then fetch them and try again
    for commands in (
        [["apt-get", "install", "-y", "-q", "nftables"]],
        [["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "nftables"]],
    ):
        if shutil.which("nft") or not shutil.which("apt-get"):
            break
        for command in commands:
            subprocess.run(command, capture_output=True, timeout=300, env=env)
    if not shutil.which("nft"):
        raise LabError(
            "the WAN lab's NAT needs nftables, which could not be installed: apt-get install nftables"
        )


def inside_address(index: int) -> str:
    """The address of NATed cluster number ``index`` inside its NAT."""
    return f"10.78.{index}.2"


def build_nat(router_ns: str, inside_ns: str, index: int, mtu: int, tcp_sysctls: list[str]) -> None:
    """Put a NAT router in ``router_ns`` (which already holds ``wan0`` and the lab's link) in front of a new
    namespace ``inside_ns``."""
    gateway = f"10.78.{index}.1"
    run("ip", "netns", "add", inside_ns)
    run("ip", "-n", inside_ns, "link", "set", "lo", "up")
    run(
        "ip", "link", "add", "lan0", "netns", router_ns, "mtu", str(mtu),
        "type", "veth", "peer", "name", "lan0", "netns", inside_ns, "mtu", str(mtu),
    )  # fmt: skip
    run("ip", "-n", router_ns, "addr", "add", f"{gateway}/24", "dev", "lan0")
    run("ip", "-n", router_ns, "link", "set", "lan0", "up")
    run("ip", "-n", inside_ns, "addr", "add", f"{inside_address(index)}/24", "dev", "lan0")
    run("ip", "-n", inside_ns, "link", "set", "lan0", "up")
    run("ip", "-n", inside_ns, "route", "add", "default", "via", gateway)
    run("ip", "netns", "exec", router_ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    run("ip", "netns", "exec", inside_ns, "sysctl", "-q", "-w", *tcp_sysctls)
    proc = subprocess.run(
        ["ip", "netns", "exec", router_ns, "nft", "-f", "-"],
        input=RULES,
        capture_output=True,
        text=True,
        timeout=20,
    )
    if proc.returncode != 0:
        raise LabError(f"nft in {router_ns}: {proc.stderr.strip() or proc.stdout.strip()}")
