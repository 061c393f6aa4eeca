"""What a WAN lab (``scripts/wan/lab.py``) leaves on the host, found and removed by run id: its network
namespaces (named ``odw-RUN_ID-…``), the processes in them and the ones it recorded in /run/open_diloco-wan.
None of it needs the process that built the lab: ``lab down``, the reaper and ``scripts/wan/control.py`` use
it too."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

PREFIX = "odw-"
RUNTIME = Path("/run/open_diloco-wan")


class LabError(RuntimeError):
    """A lab that cannot be built here; the CLI prints it as one line and exits 2."""


def run(*cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    """Run a host tool (ip, tc, sysctl); with ``check``, a failure raises LabError with what the tool said."""
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


def end_pids(pids: list[int], grace: float = 3.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace``; returns what is still alive (normally nothing)."""
    from open_diloco.processes import signal_pids, wait_gone

    signal_pids(pids, signal.SIGTERM)
    left = wait_gone(pids, grace)
    signal_pids(left, signal.SIGKILL)
    return wait_gone(left, 5.0)


def _netns_pids(ns: str) -> list[int]:
    out = run("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def lab_namespaces() -> list[str]:
    """Every network namespace any lab made (by name prefix)."""
    out = run("ip", "netns", "list", check=False).stdout
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
    left = end_pids(sorted(set(pids)))
    if left:
        raise LabError(f"processes of the lab did not end: {left}")
    for ns in namespaces:
        run("ip", "netns", "delete", ns, check=False)
    for state in states:
        state.unlink(missing_ok=True)
        shutil.rmtree(state.with_suffix(""), ignore_errors=True)
    if run_id is None:  # workdirs of labs that never wrote a state
        for leftover in RUNTIME.glob("*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return namespaces


def reap(run_id: str, pid: int) -> None:
    """Wait for process ``pid`` (the lab's owner) to end, then remove lab ``run_id``."""
    with contextlib.suppress(psutil.Error):
        owner = psutil.Process(pid)
        while owner.is_running() and owner.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.5)
    remove(run_id)
