"""How each fault is done to a running galaxy, and undone.

- ``lost_average``: tests/e2e/faults/lose_last_average on the target cluster's PYTHONPATH, armed at launch for
  one all-reduce number (the target's outer step the schedule picked, less the outer step it launches at) and
  one shard (local rank). It is timed by the mark the module writes when a reducer's stream is cut.
- ``kill_restart``: kill -9 of the cluster's whole process tree by PID, then, ``seconds`` later, the same
  command again with ``--ckpt.resume latest`` (when a checkpoint is complete; else it joins as a newcomer).
- ``partition``, ``long_partition``: the cluster's port on the lab's bridge goes down for ``seconds``
  (scripts/wan/control.py).
- ``split``: the lab's bridge splits in two for ``seconds`` (``plan.split_sides``: the cluster and the next
  ranks up to half the galaxy, with the DHT, against the rest); each side's links stay up.
- ``loss_burst``: the cluster's forwarder loses 5 % of the packets both ways for ``seconds``.
- ``slow``: SIGSTOP/SIGCONT of the cluster's rank processes, half of every second (its hivemind processes run
  on: the cluster computes at half speed, as a slower machine would, while its heartbeats stay on time).
- ``late_join``: the cluster is not started with the others but when the galaxy reaches the trigger (in an
  elastic soak, a join without a rank).
- ``leave`` (an elastic soak): SIGINT to the cluster, as its operator's Ctrl+C: it leaves by an entry and is
  never started again; the fault ends when it has exited (a SIGKILL after ``LEAVE_GRACE_S``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from scripts.chaos.galaxy import Galaxy, signal_all
from scripts.chaos.plan import BURST_LOSS_PCT, CUTS, SLOW_DUTY, SLOW_PERIOD_S, Fault, split_sides

Say = Callable[[str], None]
QUIET_SYNCS = 4  # syncs of the galaxy between the end of one fault and the start of the next
LEAVE_GRACE_S = 60.0  # what a cluster told to leave gets to exit on its own


class DutyCycle(threading.Thread):
    """Stops and continues a cluster's ranks in turn until ``stop()``, which always leaves them running."""

    def __init__(self, galaxy: Galaxy, cluster: int):
        super().__init__(daemon=True)
        self.galaxy, self.cluster = galaxy, cluster
        self._done = threading.Event()

    def run(self) -> None:
        import signal

        while not self._done.is_set():
            pids = self.galaxy.rank_pids(self.cluster)  # again each period: a rank may have ended
            signal_all(pids, signal.SIGSTOP)
            self._done.wait(SLOW_PERIOD_S * (1 - SLOW_DUTY))
            signal_all(pids, signal.SIGCONT)
            self._done.wait(SLOW_PERIOD_S * SLOW_DUTY)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)


class Injector:
    """Starts and ends the schedule's faults as the galaxy progresses; ``tick()`` once per loop turn."""

    def __init__(self, galaxy: Galaxy, faults: list[Fault], relaunch: Callable[[int, bool], None], say: Say):
        self.galaxy, self.faults, self.relaunch, self.say = galaxy, faults, relaunch, say
        self.slowing: dict[int, DutyCycle] = {}
        self.left: set[int] = set()
        """Clusters that left for good (``leave``): never started again."""
        self.progress = 0
        self.quiet_until = 0  # the galaxy's outer step before which no new fault starts

    @property
    def active(self) -> Fault | None:
        """The fault the soak is doing now (at most one; lost averages and late joins run on their own)."""
        return next(
            (
                f
                for f in self.faults
                if f.start is not None and f.end is None and f.kind not in ("lost_average", "late_join")
            ),
            None,
        )

    def _begin(self, fault: Fault, note: str = "") -> None:
        fault.start, fault.note = time.time(), note or fault.note
        self.say(f"fault start {fault.describe()}{': ' + note if note else ''}")

    def _finish(self, fault: Fault, note: str = "") -> None:
        fault.end = time.time()
        if fault.kind != "lost_average":  # let the galaxy settle: each repair is measured on its own
            self.quiet_until = self.progress + QUIET_SYNCS
        fault.note = note or fault.note
        self.say(
            f"fault end   #{fault.index} {fault.kind} on cluster {fault.cluster}{': ' + note if note else ''}"
        )

    def tick(self, progress: int) -> None:
        """``progress``: the galaxy's outer step (its clusters' median)."""
        now, self.progress = time.time(), progress
        for fault in self.faults:
            if fault.kind == "lost_average":
                self._watch_lost_average(fault)
            elif fault.kind == "late_join":
                if fault.end is None and progress >= fault.trigger:
                    self.relaunch(fault.cluster, False)
                    self._finish(fault, f"started at the galaxy's outer step {progress}")
            elif fault.start is not None and fault.end is None and now >= fault.start + fault.seconds:
                self._undo(fault)
        if self.active is None and progress >= self.quiet_until:
            due = next(
                (
                    f
                    for f in self.faults
                    if f.start is None
                    and not f.skipped
                    and progress >= f.trigger
                    and f.kind not in ("lost_average", "late_join")
                ),
                None,
            )
            if due is not None:
                self._do(due)

    def _watch_lost_average(self, fault: Fault) -> None:
        """Times the fault by the mark the fault module writes when it strikes (``Fault.strike_mark``): the
        records' count of all-reduces ran ahead of the averager's own (a retry whose matchmaking failed, a
        held round: no all-reduce), and placed the fault up to 5 minutes before it struck (soak of
        2026-12-02, 14:26), so its repair and the retries it caused were judged as faultless."""
        launch = self.galaxy.current(fault.cluster)
        if fault.end is not None or launch is None or str(launch.number) not in fault.armed:
            return  # not armed in this launch (one killed before it struck re-arms at its restart)
        mark = fault.strike_mark(self.galaxy.out, launch.number)
        try:
            struck = float(mark.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return  # not struck yet, or the line is still being written
        ordinal = fault.armed[str(launch.number)]
        self._begin(fault, f"all-reduce {ordinal} of launch {launch.number} lost its last average")
        fault.start = struck
        self._finish(fault)
        fault.end = struck

    def _do(self, fault: Fault) -> None:
        from scripts.wan import control

        if not self.galaxy.running(fault.cluster):  # it stopped on its own: the fault goes to a running one
            running = sorted(
                {launch.cluster for launch in self.galaxy.launches if self.galaxy.running(launch.cluster)}
            )
            if not running:
                fault.skipped, fault.note = True, "skipped: no cluster was running when it was due"
                self.say(f"fault skip  {fault.describe()}: {fault.note}")
                return
            fault.note = f"cluster {fault.cluster} was not running: moved to cluster {running[0]}"
            fault.cluster = running[0]
        self._begin(fault)
        if fault.kind == "kill_restart":
            left = self.galaxy.kill(fault.cluster)
            if left:
                self.say(f"kill -9 left {left} alive")
        elif fault.kind == "split":
            clusters = sum(name.startswith("c") for name in self.galaxy.lab["endpoints"])
            side, other = split_sides(fault.cluster, clusters)
            ends = ([f"c{c}" for c in side] + ["dht"], [f"c{c}" for c in other])
            control.set_split(self.galaxy.lab["run_id"], ends)
        elif fault.kind in CUTS:
            control.set_link(self.galaxy.lab["run_id"], f"c{fault.cluster}", up=False)
        elif fault.kind == "loss_burst":
            control.set_loss(self.galaxy.lab["run_id"], f"c{fault.cluster}", BURST_LOSS_PCT)
        elif fault.kind == "slow":
            self.slowing[fault.cluster] = DutyCycle(self.galaxy, fault.cluster)
            self.slowing[fault.cluster].start()
        elif fault.kind == "leave":
            self.left.add(fault.cluster)
            self.galaxy.interrupt(fault.cluster)

    def _undo(self, fault: Fault) -> None:
        from scripts.wan import control

        if fault.kind == "kill_restart":
            self.relaunch(fault.cluster, True)
        elif fault.kind == "split":
            control.set_split(self.galaxy.lab["run_id"], None)
        elif fault.kind in CUTS:
            control.set_link(self.galaxy.lab["run_id"], f"c{fault.cluster}", up=True)
        elif fault.kind == "loss_burst":
            control.set_loss(self.galaxy.lab["run_id"], f"c{fault.cluster}", None)
        elif fault.kind == "slow":
            self.slowing.pop(fault.cluster).stop()
        elif fault.kind == "leave" and self.galaxy.running(fault.cluster):
            if time.time() < fault.start + LEAVE_GRACE_S:
                return  # not gone yet: looked at again next tick
            fault.note = f"still running {LEAVE_GRACE_S:g} s after SIGINT: killed"
            self.galaxy.kill(fault.cluster)
        self._finish(fault)

    def undo_all(self) -> None:
        """End every fault in progress (the soak is stopping): links up, loss off, ranks running."""
        for fault in self.faults:
            if (
                fault.start is not None
                and fault.end is None
                and fault.kind not in ("lost_average", "kill_restart")
            ):
                try:
                    self._undo(fault)
                except Exception as err:  # the lab may be gone already; the rest must still be undone
                    self.say(f"could not undo #{fault.index} {fault.kind}: {err}")
