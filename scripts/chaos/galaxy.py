"""The soak's processes: the WAN lab, a stock `hivemind-dht` bootstrap peer and the clusters (a `torchrun` of
open_diloco/train_fsdp.py each), started, killed and restarted by PID.

Every PID the soak ever saw (each root and every descendant: ranks, hivemind's DHT and averager processes,
p2pd daemons, the lab's forwarders and reaper) is remembered with its start time, so the end of the soak can
say exactly which ones are still running, without mistaking a reused PID for a leftover, and without
``pkill``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from open_diloco.processes import descendants, descendants_of, end_tree, kill_tree

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "models" / "llama-2m-fresh"
FAULT_MODULE = Path("tests") / "e2e" / "faults" / "lose_last_average"


@dataclass
class Launch:
    """One start of one cluster (a restart is a new launch, appending to the same metrics file)."""

    cluster: int
    number: int
    proc: subprocess.Popen
    log: Path
    started: float
    killed: bool = False  # by the soak (a fault), so its exit code says nothing about the trainer
    returncode: int | None = None
    ended: float | None = None

    def to_json(self) -> dict:
        return {
            "cluster": self.cluster,
            "launch": self.number,
            "pid": self.proc.pid,
            "log": self.log.name,
            "started": self.started,
            "ended": self.ended,
            "returncode": self.returncode,
            "killed": self.killed,
        }


@dataclass
class Galaxy:
    """Where the soak's processes run (``lab``: the lab's ready-file description, None on 127.0.0.1)."""

    out: Path
    python: str
    trainer_root: Path
    seen: dict[int, float] = field(default_factory=dict)  # pid -> create time
    roots: list[subprocess.Popen] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    lab: dict | None = None
    lab_proc: subprocess.Popen | None = None
    dht_proc: subprocess.Popen | None = None
    maddr: str = ""

    # -- where things run ---------------------------------------------------------------------------------
    def place(self, endpoint: str) -> list[str]:
        """The command prefix that runs something in ``endpoint``'s namespace (nothing without a lab)."""
        return ["ip", "netns", "exec", self.lab["endpoints"][endpoint]["netns"]] if self.lab else []

    def address(self, endpoint: str) -> str:
        return self.lab["endpoints"][endpoint]["address"] if self.lab else "127.0.0.1"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The trainers' environment: quiet, offline, one thread per rank (the soak shares two cores with
        everything else), and the trainer root first on PYTHONPATH (so a worktree of older code can run)."""
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "WANDB_MODE": "disabled",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        env["PYTHONPATH"] = os.pathsep.join([str(self.trainer_root), *filter(None, [env.get("PYTHONPATH")])])
        for key, value in (extra or {}).items():
            env[key] = os.pathsep.join([value, env[key]]) if key == "PYTHONPATH" else value
        return env

    def package_file(self) -> str:
        """Where the trainers import open_diloco from (the proof of which code a soak ran)."""
        probe = [self.python, "-c", "import open_diloco; print(open_diloco.__file__)"]
        return subprocess.run(
            probe, cwd=self.trainer_root, env=self.env(), capture_output=True, text=True, timeout=60
        ).stdout.strip()

    def _spawn(
        self, cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        with log.open("a") as sink:
            proc = subprocess.Popen(
                cmd,
                cwd=cwd or REPO,
                env=env or self.env(),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        self.roots.append(proc)
        self.track()
        return proc

    # -- the lab and the DHT ----------------------------------------------------------------------------
    def start_lab(self, clusters: int, profile: str, timeout: float = 120) -> None:
        """``python -m scripts.wan.lab up`` (self-check included), held until close()."""
        ready = self.out / "lab.json"
        self.lab_proc = self._spawn(
            [
                self.python,
                "-m",
                "scripts.wan.lab",
                "up",
                "--clusters",
                str(clusters),
                "--profile",
                profile,
                "--ready-file",
                str(ready),
            ],
            self.out / "lab.log",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + timeout
        while not (ready.exists() and ready.stat().st_size):
            if self.lab_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the WAN lab did not come up; see {self.out / 'lab.log'}")
            time.sleep(0.5)
        self.lab = json.loads(ready.read_text())

    def start_dht(self, timeout: float = 60) -> str:
        """The stock bootstrap peer; returns its multiaddr (read from its INFO line)."""
        host, log = self.address("dht"), self.out / "dht.log"
        dht_bin = str(Path(self.python).parent / "hivemind-dht")
        self.dht_proc = self._spawn(
            [
                *self.place("dht"),
                dht_bin,
                "--identity_path",
                str(self.out / "dht_identity.pem"),
                "--host_maddrs",
                f"/ip4/{host}/tcp/0",
            ],
            log,
            env={**self.env(), "HIVEMIND_LOGLEVEL": "INFO"},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(rf"/ip4/{re.escape(host)}/tcp/\d+/p2p/\w+", log.read_text())
            if found:
                self.maddr = found.group(0)
                return self.maddr
            if self.dht_proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"hivemind-dht did not start; see {log}")

    # -- clusters ------------------------------------------------------------------------------------------
    def launch(self, cluster: int, ranks: int, flags: list[str], env: dict[str, str] | None = None) -> Launch:
        """Start cluster ``cluster`` (``flags``: every trainer flag); a restart logs to a file of its own."""
        number = 1 + sum(launch.cluster == cluster for launch in self.launches)
        log = self.out / (f"cluster{cluster}.log" if number == 1 else f"cluster{cluster}.launch{number}.log")
        cmd = [
            *self.place(f"c{cluster}"),
            self.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            str(self.trainer_root / "open_diloco" / "train_fsdp.py"),
            *flags,
        ]
        proc = self._spawn(cmd, log, env=self.env(env), cwd=self.trainer_root)
        launch = Launch(cluster, number, proc, log, time.time())
        self.launches.append(launch)
        return launch

    def current(self, cluster: int) -> Launch | None:
        return next((launch for launch in reversed(self.launches) if launch.cluster == cluster), None)

    def running(self, cluster: int) -> bool:
        launch = self.current(cluster)
        return launch is not None and launch.proc.poll() is None

    def rank_pids(self, cluster: int) -> list[int]:
        """The cluster's rank processes (torchrun's children), not hivemind's helpers below them."""
        launch = self.current(cluster)
        with contextlib.suppress(psutil.Error):
            if launch is not None:
                return [child.pid for child in psutil.Process(launch.proc.pid).children()]
        return []

    def kill(self, cluster: int) -> list[int]:
        """kill -9 the cluster's whole process tree at once (torchrun, ranks, hivemind's processes); returns
        what did not die (normally nothing)."""
        launch = self.current(cluster)
        if launch is None or launch.proc.poll() is not None:
            return []
        self.track()
        launch.killed = True
        left = kill_tree(launch.proc.pid, signal.SIGKILL, timeout=20)
        self.poll()
        return left

    def interrupt(self, cluster: int) -> None:
        """SIGINT to the cluster's torchrun (it forwards it to the ranks), as its operator's Ctrl+C: the
        soak's doing, so its exit code says nothing about the trainer."""
        launch = self.current(cluster)
        if launch is not None and launch.proc.poll() is None:
            launch.killed = True
            signal_all([launch.proc.pid], signal.SIGINT)

    def poll(self) -> None:
        """Record the exit code and time of every launch that ended."""
        for launch in self.launches:
            if launch.returncode is None and launch.proc.poll() is not None:
                launch.returncode, launch.ended = launch.proc.returncode, time.time()

    def track(self) -> None:
        """Remember every process below every root now (one pass over the process table)."""
        roots = {proc.pid for proc in self.roots}
        for pid in roots | descendants_of(roots):
            if pid not in self.seen:
                with contextlib.suppress(psutil.Error):
                    self.seen[pid] = psutil.Process(pid).create_time()

    # -- the end -------------------------------------------------------------------------------------------
    def stop_all(self, grace: float = 10) -> None:
        """End what still runs: clusters (SIGTERM, then SIGKILL), the DHT, then the lab (it removes its
        namespaces and whatever is left in them)."""
        self.track()
        for launch in self.launches:
            if launch.proc.poll() is None:
                launch.killed = (
                    True  # by the soak's end (a hang): its "stopping" line is ours, not the trainer's
                )
                signal_all(psutil_tree(launch.proc.pid), signal.SIGCONT)  # a stopped process ignores SIGTERM
                end_tree(launch.proc.pid, grace=grace)
        self.poll()
        if self.dht_proc is not None and self.dht_proc.poll() is None:
            end_tree(self.dht_proc.pid, grace=3)
        if self.lab_proc is not None and self.lab_proc.poll() is None:
            self.lab_proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.lab_proc.wait(timeout=60)
        for proc in self.roots:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def left_running(self, wait: float = 15) -> list[dict]:
        """Every process the soak saw that still runs (same PID and start time), after up to ``wait`` s for
        stragglers (the lab's reaper, a p2pd finishing); each is then ended by PID so none outlives the
        soak."""
        deadline = time.monotonic() + wait
        while (left := self._alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for item in left:
            with contextlib.suppress(psutil.Error):
                psutil.Process(item["pid"]).kill()
        return left

    def _alive(self) -> list[dict]:
        living = []
        for pid, created in self.seen.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if abs(proc.create_time() - created) < 1 and proc.status() != psutil.STATUS_ZOMBIE:
                    living.append({"pid": pid, "cmd": " ".join(proc.cmdline())[:160]})
        return living


def psutil_tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def fault_path(trainer_root: Path) -> Path:
    """The lost-average fault module: the trainer root's copy, else this checkout's."""
    own = trainer_root / FAULT_MODULE
    return own if own.is_dir() else REPO / FAULT_MODULE


def python_default() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable
