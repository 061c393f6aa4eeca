"""One soak from start to end: the lab, the DHT, the clusters, the fault schedule driven by the galaxy's
progress, a global wall-clock limit, and a shutdown that leaves nothing running (checked, not hoped)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from scripts.chaos.galaxy import MODEL, Galaxy, Launch, fault_path
from scripts.chaos.inject import Injector
from scripts.chaos.plan import Fault
from scripts.chaos.records import MetricsTail

TICK_S = 0.5


@dataclass
class SoakConfig:
    """What to run; ``extra``: trainer flags that replace the soak's defaults (never its identity flags)."""

    clusters: int
    ranks: int
    profile: str | None
    steps: int
    local_steps: int
    fragments: int
    faults: int
    kinds: list[str]
    seed: int
    timeout: float
    out: Path
    trainer_root: Path
    python: str
    extra: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)  # fault seconds by kind, replacing plan's
    elastic: bool = False
    """Clusters without ``--hv.world-rank``: each known by an id (:func:`soak_ids`), the galaxy's first round
    needing the clusters started at once (``genesis``), the late joiner joining without a rank."""
    genesis: int = 0

    @property
    def stride(self) -> int:
        """Inner steps between two syncs, H/P (and the sync delay τ the soak streams at)."""
        return self.local_steps // self.fragments

    @property
    def total_syncs(self) -> int:
        return self.steps // self.stride


def with_overrides(defaults: list[str], extra: list[str]) -> list[str]:
    """``defaults`` (flag/value pairs) then ``extra``, without each default ``extra`` sets again (the CLI
    refuses a flag given twice); ``--flag=value`` counts as setting ``--flag``."""
    given = {arg.split("=", 1)[0] for arg in extra if arg.startswith("--")}
    base: list[str] = []
    for flag, value in zip(defaults[::2], defaults[1::2], strict=True):
        if flag not in given:
            base += [flag, value]
    return [*base, *extra]


def matchmaking_flags(cfg: SoakConfig) -> list[str]:
    """``--hv.matchmaking-time`` on loopback only (1 s: the suite's quick soak waits less for a lost cluster).
    Over the lab the trainer's default runs: each round's window follows the galaxy's whole rounds
    (``outer/matchmaking.py``). Until 2026-12-01 the soak passed 8 s there by hand, to cover a re-synced
    cluster's download (6-7 s at 10 Mbit/s; at 1 s such a cluster missed every later round,
    docs/results/chaos-soak.md)."""
    return ["--hv.matchmaking-time", "1.0"] if cfg.profile in (None, "none") else []


def soak_ids(clusters: int) -> list[str]:
    """Cluster ids for an elastic soak whose galaxy ranks (``cluster_id.rank_of``) rise with the soak's own
    cluster numbers: the soak's rules that name a side by its lowest rank (``plan.split_sides``,
    ``plan.minority_of``: the quorum's tie-break) read the same as in a fixed galaxy."""
    from open_diloco.cluster_id import rank_of

    ids: list[str] = []
    for cluster in range(clusters):
        above = rank_of(ids[-1]) if ids else -1
        ids.append(next(i for n in range(10_000) if rank_of(i := f"soak-c{cluster}-{n}") > above))
    return ids


def trainer_flags(cfg: SoakConfig, cluster: int, maddr: str, address: str | None) -> list[str]:
    """Every flag of cluster ``cluster``: the soak's defaults (replaceable), then its identity (fixed)."""
    h = cfg.local_steps
    defaults = [
        "--path-model",
        str(MODEL),
        "--seq-length",
        "128",
        "--per-device-train-batch-size",
        "4",
        "--total-batch-size",
        str(4 * cfg.ranks),
        "--lr",
        "1e-2",
        "--warmup-steps",
        "5",
        "--num-workers",
        "0",
        "--log-interval",
        "10",
        "--max-steps",
        str(cfg.steps),
        "--hv.local-steps",
        str(h),
        "--hv.fragments",
        str(cfg.fragments),
        "--hv.sync-delay",
        str(cfg.stride),
        *matchmaking_flags(cfg),
        "--ckpt.interval",
        str(2 * h),
        "--ckpt.path",
        str(cfg.out / f"ckpt{cluster}"),
        "--ckpt.keep",
        "2",
    ]
    switches = ["--fake-data"] + (
        [] if any("torch-compile" in arg for arg in cfg.extra) else ["--no-torch-compile"]
    )
    identity = [
        "--metric-logger-type",
        "jsonl",
        "--metrics-path",
        str(cfg.out / f"cluster{cluster}.jsonl"),
        "--run-name",
        f"cluster{cluster}",
        "--hv.initial-peers",
        maddr,
        "--hv.galaxy-size",
        str(cfg.genesis or cfg.clusters if cfg.elastic else cfg.clusters),
    ]
    if cfg.elastic:  # (and the debug log of the samples read: the soak audits the pages the ledger dealt)
        identity += ["--hv.cluster-id", soak_ids(cfg.clusters)[cluster]]
        identity += ["--sample-log", str(cfg.out / "samples")]
    else:
        identity += ["--hv.world-rank", str(cluster)]
    identity += ["--hv.host-maddrs", f"/ip4/{address or '127.0.0.1'}/tcp/0"]  # never the machine's others
    return [*switches, *with_overrides(defaults, cfg.extra), *identity]


def has_checkpoint(root: Path) -> bool:
    """A complete checkpoint under ``root`` (what ``--ckpt.resume latest`` takes): not a ``.tmp``, with
    metadata."""
    return any(
        p.is_dir() and not p.name.endswith(".tmp") and (p / "metadata.json").is_file()
        for p in root.glob("step_*")
    )


@dataclass
class SoakRun:
    """What the run left for the analysis."""

    started: float
    finished: float
    hung: bool
    tails: list[MetricsTail]
    left_running: list[dict]
    package_file: str
    lab: dict | None
    launches: list[Launch]
    loads: list[float]


class Soak:
    def __init__(self, cfg: SoakConfig, faults: list[Fault], say: Callable[[str], None]):
        self.cfg, self.faults, self.say = cfg, faults, say
        self.galaxy = Galaxy(cfg.out, cfg.python, cfg.trainer_root)
        self.tails = [MetricsTail(cfg.out / f"cluster{c}.jsonl") for c in range(cfg.clusters)]
        self.injector = Injector(self.galaxy, faults, self.launch, say)
        self.loads: list[float] = []  # 1-minute load average, once a minute
        self._next_load = 0.0

    def leader(self) -> int:
        """The most advanced cluster's outer step: where a restart or a late joiner picks up."""
        return max(tail.outer_step for tail in self.tails)

    def progress(self) -> int:
        """The galaxy's outer step as the schedule reads it: the lower median of the started clusters' (a
        partitioned cluster racing ahead alone, or a killed one standing still, does not move it)."""
        steps = sorted(self.tails[c].outer_step for c in range(self.cfg.clusters) if self.galaxy.current(c))
        return steps[(len(steps) - 1) // 2] if steps else 0

    def launch(self, cluster: int, resume: bool) -> None:
        """Start (or restart) a cluster, arming a lost average aimed at it that has not struck yet."""
        g, cfg = self.galaxy, self.cfg
        flags = trainer_flags(cfg, cluster, g.maddr, g.address(f"c{cluster}") if g.lab else None)
        if resume and has_checkpoint(cfg.out / f"ckpt{cluster}") and "--ckpt.resume" not in cfg.extra:
            flags += ["--ckpt.resume", "latest"]
        number = 1 + sum(launch.cluster == cluster for launch in g.launches)
        base = self.leader()  # where a restart or a late joiner picks up: the galaxy's outer step
        env: dict[str, str] = {}
        for fault in self.faults:
            if fault.kind == "lost_average" and fault.cluster == cluster and fault.start is None:
                ordinal = fault.trigger - base
                if ordinal >= 2:  # its first all-reduce may be a join: aim past it
                    env = {
                        "PYTHONPATH": str(fault_path(cfg.trainer_root)),
                        "OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_OF": str(ordinal),
                        "OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_MARK": str(fault.strike_mark(cfg.out, number)),
                    }
                    if fault.shard is not None:
                        env["OPEN_DILOCO_TEST_LOSE_LAST_AVERAGE_RANK"] = str(fault.shard)
                    fault.armed[str(number)] = ordinal
                    self.say(f"armed  {fault.describe()}: all-reduce {ordinal} of launch {number}")
        launch = g.launch(cluster, cfg.ranks, flags, env)
        self.say(
            f"launch cluster {cluster} #{launch.number} (pid {launch.proc.pid})"
            + (" from its checkpoint" if "--ckpt.resume" in flags else "")
        )

    def _done(self) -> bool:
        """Every started cluster ended and no fault will start one again."""
        if any(self.galaxy.running(c) for c in range(self.cfg.clusters)):
            return False
        restarting = self.injector.active is not None and self.injector.active.kind == "kill_restart"
        return not restarting

    def run(self) -> SoakRun:
        cfg, g = self.cfg, self.galaxy
        started, hung, package = time.time(), False, ""
        try:
            if cfg.profile:
                g.start_lab(cfg.clusters, cfg.profile)
                self.say(f"lab {g.lab['run_id']} up ({cfg.profile}); self-check {g.lab.get('check')}")
            package = g.package_file()
            self.say(f"trainers import {package}")
            self.say(f"DHT at {g.start_dht()}")
            late = {f.cluster for f in self.faults if f.kind == "late_join"}
            for fault in self.faults:
                if fault.kind == "late_join":
                    fault.start = started
            for cluster in range(cfg.clusters):
                if cluster not in late:
                    self.launch(cluster, resume=False)
            hung = self._loop(started)
        finally:
            self.injector.undo_all()
            for fault in self.faults:
                if fault.start is not None and fault.end is None and fault.kind != "lost_average":
                    fault.note = (
                        fault.note + "; " if fault.note else ""
                    ) + "never ended: the soak stopped first"
            g.stop_all()
        for tail in self.tails:
            tail.read()
        left = g.left_running()
        return SoakRun(started, time.time(), hung, self.tails, left, package, g.lab, g.launches, self.loads)

    def _loop(self, started: float) -> bool:
        """Drive the schedule until every cluster ended; True if the wall-clock limit ran out first."""
        while True:
            self.galaxy.track()
            self.galaxy.poll()
            for tail in self.tails:
                tail.read()
            self.injector.tick(self.progress())
            if self._done():
                return False
            if time.time() >= self._next_load:  # the machine's load: a soak's pace is the machine's as well
                self.loads.append(round(os.getloadavg()[0], 2))
                self._next_load = time.time() + 60
            if time.time() - started > self.cfg.timeout:
                self.say(f"HANG: the soak ran past --timeout {self.cfg.timeout:g} s; stopping everything")
                return True
            time.sleep(TICK_S)
