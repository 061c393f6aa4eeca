"""A real galaxy on this machine, for tests and benchmarks: a `hivemind-dht` bootstrap peer and torchrun
clusters, on 127.0.0.1 or, given a WAN lab (scripts/wan/lab.py), each in its own network namespace of the lab.

Every process is tracked by PID (with all its descendants: ranks, hivemind's DHT/averager processes, p2pd
daemons) and ended by PID; :meth:`Galaxy.close` checks that none is left. It runs the trainer of a source
checkout (:data:`REPO`). A failed check raises :class:`AssertionError`, which is what a test or a benchmark
expects of it (raised explicitly: ``python -O`` drops ``assert`` statements).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from open_diloco import processes
from open_diloco.processes import alive, descendants

REPO = Path(__file__).resolve().parents[1]
"""The source checkout this module runs from."""
TINY_MODEL = REPO / "tests" / "models" / "llama-2m-fresh"
"""The 2M-parameter model (6 blocks) of the single-cluster tests: learning shows within 50 steps."""
SHALLOW_MODEL = REPO / "tests" / "models" / "llama-1m-fresh"
"""The 2M model with 2 blocks instead of 6 (1M parameters): what a :class:`Galaxy`'s clusters train
unless given ``--path-model``, and the model of tests that assert rounds, hashes and resumes rather than
learning. A step costs about half as much (2.5 → 1.2 CPU-s for 30 steps on one rank), and the suite starts
well over a hundred trainer ranks."""
TRAIN_SCRIPT = REPO / "open_diloco" / "train_fsdp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STOP_BUDGET = 15.0
"""Seconds from a stop signal to the end of every rank of a cluster and every hivemind process (DHT, averager,
p2pd) under them: within what a batch system or ``docker stop`` waits before SIGKILL."""
TRACK_SECONDS = 1.0
"""How often a polling wait looks for the galaxy's new processes (hivemind's forks, p2pd): they live as long
as their rank, and each look reads the machine's whole process table."""
LAUNCHER_EXIT_SECONDS = 30.0
"""Seconds more for torchrun itself to exit once its ranks are gone. That is torch's launcher tearing down
its own interpreter (a final garbage collection of torch's whole import graph: 0.8 s on an idle 2-core
machine, 2.4 s beside four CPU burners, more in a loaded CI run), not a rank of ours."""


def check(condition: object, message: str) -> None:
    """Raise :class:`AssertionError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise AssertionError(message)


def trainer_env() -> dict[str, str]:
    """Environment of spawned trainers: quiet, offline, one thread per rank on the 2-core CI machine."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def read_metrics(path: Path) -> list[dict]:
    """The per-step records of a jsonl metrics file (the `start` record excluded), whole lines only: a
    read while the trainer writes can see the first part of its last line (a WAN test read 54 characters)."""
    text = Path(path).read_text()
    whole_lines = text[: text.rfind("\n") + 1]
    return [rec for rec in map(json.loads, whole_lines.splitlines()) if "step" in rec]


def kill_tree(pid: int, sig: int = signal.SIGKILL, timeout: float = 20.0) -> None:
    """Send ``sig`` to ``pid`` and every descendant, by PID; raise unless all are gone within ``timeout``."""
    left = processes.kill_tree(pid, sig, timeout)
    check(not left, f"processes still alive after signal {sig}: {left}")


def with_overrides(defaults: list[str], extra: tuple[str, ...] | list[str]) -> list[str]:
    """``defaults`` (flag/value pairs) followed by ``extra``, dropping each default flag that ``extra`` sets
    again (the CLI refuses a flag given twice)."""
    base = list(defaults)
    for flag in {arg for arg in extra if arg.startswith("--")} & set(base):
        at = base.index(flag)
        del base[at : at + 2]
    return [*base, *extra]


HIVEMIND_DHT = str(Path(sys.executable).parent / "hivemind-dht")

CLUSTER_ARGS = [
    "--path-model",
    str(SHALLOW_MODEL),
    "--fake-data",
    "--no-torch-compile",
    "--seq-length",
    "64",
    "--lr",
    "1e-2",
    "--warmup-steps",
    "5",
    "--per-device-train-batch-size",
    "4",
    "--num-workers",
    "0",
    "--metric-logger-type",
    "jsonl",
    "--hv.matchmaking-time",
    "1.0",
    "--hv.averaging-timeout",
    "60",
    "--hv.join-timeout",
    "10",
]


class Galaxy:
    """A DHT and the clusters started on it, all writing their logs and metrics under ``workdir``."""

    def __init__(self, workdir: Path, lab=None):
        """``lab``: a started ``scripts.wan.lab.Lab``; the DHT then runs in its ``dht`` namespace and cluster
        ``rank`` in ``cluster{rank}``'s, each listening on its lab address."""
        self.workdir = workdir
        self.lab = lab
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen_pids: set[int] = set()
        self._tracked_at = -math.inf
        self.maddr = self._start_dht()

    def _start_dht(self) -> str:
        log = self.workdir / "dht.log"
        host = self.lab.address("dht") if self.lab else "127.0.0.1"
        proc = subprocess.Popen(
            [
                *self._place("dht"),
                HIVEMIND_DHT,
                "--host_maddrs",
                f"/ip4/{host}/tcp/0",
                "--identity_path",
                str(self.workdir / "dht.pem"),
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            # its INFO line carries the address; importing open_diloco.galaxy in this process (a unit test
            # does) sets HIVEMIND_LOGLEVEL=WARNING for every child otherwise
            env={**trainer_env(), "HIVEMIND_LOGLEVEL": "INFO"},
        )
        self.procs["dht"] = proc
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = re.search(rf"/ip4/{re.escape(host)}/tcp/\d+/p2p/\w+", log.read_text())
            if found:
                return found.group(0)
            check(proc.poll() is None, log.read_text())
            time.sleep(0.2)
        raise AssertionError(f"hivemind-dht did not start: {log.read_text()}")

    def start_cluster(
        self,
        rank: int | None,
        size: int,
        *extra: str,
        nproc: int = 2,
        name: str | None = None,
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = (),
    ) -> Path:
        """Launch cluster ``rank`` of a galaxy of ``size``; returns its metrics path. ``env``: added to the
        trainers' environment (a fault injected into one cluster, say); ``launcher``: torchrun's own flags
        (``--max-restarts=2``). ``rank`` None: a cluster of an elastic galaxy, known by ``name`` (its id is
        kept in its own ``--ckpt.path``, ``<workdir>/<name>-ckpt`` unless given)."""
        name = name or f"cluster{rank}"
        metrics = self.workdir / f"{name}.jsonl"
        identity = [
            "--total-batch-size",
            str(4 * nproc),
            "--metrics-path",
            str(metrics),
            "--run-name",
            name,
            "--hv.initial-peers",
            self.maddr,
            "--hv.galaxy-size",
            str(size),
        ]
        identity += ["--hv.world-rank", str(rank)] if rank is not None else []
        if rank is None and "--ckpt.path" not in extra:
            identity += ["--ckpt.path", str(self.workdir / f"{name}-ckpt")]
        endpoint = f"cluster{rank}" if rank is not None else name  # (the lab's name for where it runs)
        if "--hv.host-maddrs" not in extra:  # loopback, or the lab address: never this machine's others
            host = self.lab.listen_address(endpoint) if self.lab else "127.0.0.1"
            identity += ["--hv.host-maddrs", f"/ip4/{host}/tcp/0"]
        flags = with_overrides(CLUSTER_ARGS, extra)
        cmd = [
            *self._place(endpoint),
            *TORCHRUN,
            "--standalone",
            f"--nproc_per_node={nproc}",
            *launcher,
            str(TRAIN_SCRIPT),
            *flags,
            *identity,
        ]
        log = (self.workdir / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(
            cmd, cwd=REPO, env={**trainer_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )
        return metrics

    def _place(self, endpoint: str) -> list[str]:
        """The prefix that runs a command where ``endpoint`` lives (nothing on 127.0.0.1)."""
        return self.lab.exec_prefix(endpoint) if self.lab else []

    def track(self, *, every: float = 0.0) -> None:
        """Remember every process the galaxy has now, so close() can check that all of them ended. Polling
        loops pass ``every``: one look a second is enough for processes that live as long as a rank."""
        now = time.monotonic()
        if now - self._tracked_at < every:
            return
        self._tracked_at = now
        roots = {proc.pid for proc in self.procs.values()}
        self.seen_pids.update(roots | processes.descendants_of(roots))

    def wait(self, name: str, timeout: float) -> int:
        """Wait for process ``name`` (a cluster's name, or ``dht``) to end; its exit code."""
        deadline = time.monotonic() + timeout
        proc = self.procs[name]
        while proc.poll() is None and time.monotonic() < deadline:
            self.track(every=TRACK_SECONDS)
            time.sleep(0.2)
        check(proc.poll() is not None, f"{name} did not finish in {timeout} s:\n{self.log(name)[-3000:]}")
        return proc.returncode

    def stop(self, name: str, sig: signal.Signals, budget: float = STOP_BUDGET) -> float:
        """Send ``sig`` to cluster ``name``'s torchrun, as Ctrl+C or a batch system does, and check that its
        ranks and their hivemind processes end within ``budget`` s and torchrun within
        :data:`LAUNCHER_EXIT_SECONDS` after them. Returns the seconds the ranks took; the exit code is the
        process's ``returncode``."""
        torchrun = self.procs[name]
        self.track()
        tree = descendants(torchrun.pid)
        started = time.monotonic()
        torchrun.send_signal(sig)
        left = processes.wait_gone(tree, budget)
        took = time.monotonic() - started
        check(not left, f"{name}: {alive(left)} alive {budget} s after {sig.name}:\n{self.log(name)[-3000:]}")
        self.wait(name, LAUNCHER_EXIT_SECONDS)
        return took

    def socket_files(self, name: str) -> set[str]:
        """The unix socket files process ``name``'s tree listens on now (p2pd's and its clients', in /tmp)."""
        root = self.procs[name].pid
        return processes.unix_socket_files([root, *descendants(root)])

    def wait_for_step(self, metrics: Path, step: int, timeout: float) -> None:
        """Wait until the cluster writing ``metrics`` logged inner step ``step``; raise if it exits first."""
        deadline = time.monotonic() + timeout
        proc = self.procs[metrics.stem]
        while time.monotonic() < deadline:
            tail = self.log(metrics.stem)[-3000:]
            check(proc.poll() is None, f"{metrics.stem} exited ({proc.returncode}):\n{tail}")
            self.track(every=TRACK_SECONDS)
            if metrics.exists() and any(r["step"] >= step for r in read_metrics(metrics)):
                return
            time.sleep(0.2)
        raise AssertionError(f"{metrics.name} did not reach step {step} in {timeout} s")

    @contextlib.contextmanager
    def paused(self, name: str):
        """Process ``name``'s whole tree (torchrun, its ranks, their hivemind processes and p2pd daemons)
        stopped with SIGSTOP until the block ends: to the rest of the galaxy the cluster is silent, as if its
        link were cut, and it goes on where it was, as after the cut heals."""
        root = self.procs[name].pid
        tree = [psutil.Process(pid) for pid in [root, *descendants(root)]]
        for process in tree:
            process.suspend()
        try:
            yield
        finally:
            for process in reversed(tree):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.resume()

    def wait_until_together(self, metrics: list[Path], after: int, seconds: float) -> int | None:
        """Poll the clusters' metrics for up to ``seconds``: the first round after ``after`` that every one of
        them averaged with all the others into one hash (:func:`first_round_together`), or ``None``. A file
        not written yet (a cluster just started) counts as no round."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.track()
            rounds = [outer_records(m) if m.exists() else {} for m in metrics]
            if (together := first_round_together(rounds, after)) is not None:
                return together
            time.sleep(1.0)
        return None

    def log(self, name: str) -> str:
        """What process ``name`` printed so far."""
        return (self.workdir / f"{name}.log").read_text()

    def close(self) -> None:
        """End every process by PID, the DHT last (``kill_tree`` also removes the socket files the killed ones
        leave in /tmp), and check that none of the processes ever seen is left."""
        self.track()
        for name, proc in self.procs.items():
            if proc.poll() is None and name != "dht":
                kill_tree(proc.pid)
        kill_tree(self.procs["dht"].pid, timeout=30)
        for proc in self.procs.values():
            proc.wait(timeout=10)
        deadline = time.monotonic() + 20  # hivemind's DHT/averager children and p2pd exit after their parents
        while alive(sorted(self.seen_pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive(sorted(self.seen_pids))
        details = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for pid in left}
        check(not left, f"processes left behind: {details}")


def outer_records(metrics: Path) -> dict[int, dict]:
    """A cluster's records of outer steps, by outer step (a round that held, committing nothing, made none:
    ``outer/quorum.py``)."""
    return {
        r["outer_step"]: r
        for r in read_metrics(metrics)
        if "outer_step" in r and r.get("round_outcome") != "held"
    }


def first_round_together(rounds: list[dict[int, dict]], after: int = 0) -> int | None:
    """The first outer step after ``after`` in every cluster's records (``outer_records`` of each) at which
    each averaged with all the others (as many peers as clusters) and all hold one ``param_hash``; ``None``
    when there is none yet. A resumed cluster's file holds both its runs: ``after`` skips the first."""
    shared = set.intersection(*(set(side) for side in rounds)) if rounds else set()
    for r in sorted(step for step in shared if step > after):
        records = [side[r] for side in rounds]
        if all(rec["galaxy_peers"] == len(rounds) for rec in records) and (
            len({rec["param_hash"] for rec in records}) == 1
        ):
            return r
    return None


def repaired(record: dict) -> bool:
    """This cluster did not apply its own average this round but took the state of a cluster that committed
    it: the round itself (its Δ included: ``adopted``) or another trajectory (``resynced``)."""
    return bool(record.get("resynced")) or record.get("round_outcome") == "adopted"


def round_was_clean(record: dict) -> bool:
    """A round's record says it went without a hitch here: no retry, no re-sync, in sync."""
    return not record["retries"] and not record.get("resynced") and record["in_sync"]
