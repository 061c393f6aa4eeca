"""A lab's self-check: the RTT and the rate measured from its first cluster to its second (or to the DHT),
against what the profile promises, ±10 % (``scripts/wan/probe.py`` measures)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from scripts.wan.namespaces import LabError, end_pids, run

if TYPE_CHECKING:
    from scripts.wan.lab import Lab

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.10


def self_check(lab: Lab, port: int = 7777) -> dict:
    """Measure RTT and rate from the first cluster to another without a NAT (or the DHT) against the profile.
    Returns the figures and ``ok`` (both within ±10 %)."""
    # the far end must accept what starts outside it: a cluster without a NAT, else the DHT
    src = "c0"
    dst = next((f"c{i}" for i in range(1, lab.clusters) if f"c{i}" not in lab.nat), "dht")
    server = subprocess.Popen(
        [
            *lab.exec_prefix(dst),
            lab.python,
            "-m",
            "scripts.wan.probe",
            "serve",
            lab.listen_address(dst),
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
        rate = lab.profile.path_mbit()
        out = run(
            *lab.exec_prefix(src),
            lab.python,
            "-m",
            "scripts.wan.probe",
            "measure",
            lab.address(dst),
            str(port),
            str(rate),
            timeout=60,
        ).stdout
    finally:
        end_pids([server.pid])
        server.wait(timeout=5)
    got = json.loads(out.strip().splitlines()[-1])
    figures = {
        "profile": lab.profile.name,
        "path": f"{src} -> {dst}",
        "rtt_ms": got["rtt_ms"],
        "rtt_expected_ms": lab.profile.rtt_ms,
        "mbit": got["mbit"],
        "mbit_expected": rate,
    }
    figures["rtt_ok"] = got["rtt_ms"] is not None and abs(got["rtt_ms"] / lab.profile.rtt_ms - 1) <= TOLERANCE
    figures["rate_ok"] = got["mbit"] is not None and abs(got["mbit"] / rate - 1) <= TOLERANCE
    figures["ok"] = figures["rtt_ok"] and figures["rate_ok"]
    return figures


def format_check(fig: dict) -> str:
    """The self-check's figures as one line."""

    def fmt(value, unit):
        return "none" if value is None else f"{value:.4g} {unit}"

    verdict = "ok" if fig["ok"] else "OFF by more than ±10 %"
    return (
        f"self-check {fig['profile']} ({fig['path']}): RTT {fmt(fig['rtt_ms'], 'ms')} (profile "
        f"{fig['rtt_expected_ms']:g} ms), rate {fmt(fig['mbit'], 'Mbit/s')} (profile {fig['mbit_expected']:g}"
        f" Mbit/s): {verdict}"
    )
