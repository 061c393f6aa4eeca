"""The soak's seeded fault schedule: which fault, on which cluster, when, for how long.

Faults are placed by the galaxy's progress (the clusters' median outer step), not by the clock: a run's pace
depends on the machine and the link, and a fault aimed at "sync 40" lands in the same phase of the run on any
machine. Faults that take the soak's hands (a kill, a partition, a burst, a slow-down) run one at a time, so
each repair is measured from a galaxy that was healthy before it; a lost average is armed in the trainer at
launch and fires on its own clock; a late joiner is the run's first fault.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = (
    "lost_average",
    "kill_restart",
    "partition",
    "late_join",
    "slow",
    "loss_burst",
    "long_partition",
    "split",
)
ELASTIC_KINDS = (*KINDS, "leave")
"""An elastic soak's (``--elastic``: clusters without ``--hv.world-rank``): a late joiner joins without a
rank, and ``leave`` stops a cluster for good with SIGINT (it leaves by an entry; never started again)."""
CUTS = frozenset({"partition", "long_partition", "split"})
"""Kinds that cut links (``long_partition``: issue 49's 60 s cut, which a cluster trained through alone,
ahead, before the quorum; now it holds; ``split``: the galaxy in two halves, :func:`split_sides`)."""
SPLIT_MIN_CLUSTERS = 4  # a split of fewer is a partition of one cluster
NEEDS_LAB = CUTS | {"loss_burst"}  # they act on the lab's links
DURATION_S = {
    "kill_restart": 5.0,
    "partition": 30.0,
    "loss_burst": 30.0,
    "slow": 60.0,
    "long_partition": 60.0,
    "split": 60.0,
}
BURST_LOSS_PCT = 5.0
SLOW_DUTY = 0.5  # share of each period a slowed cluster's ranks may run
SLOW_PERIOD_S = 1.0
FIRST, LAST = (
    0.1,
    0.75,
)  # the share of the run's syncs faults are spread over: room to heal after the last one


@dataclass
class Fault:
    """One fault of the schedule and, once the soak ran, what happened to it (times are Unix seconds)."""

    index: int
    kind: str
    cluster: int
    trigger: int  # the galaxy's outer step (run.Soak.progress) that starts it; lost_average: the target's own
    seconds: float = 0.0  # how long it lasts (kill_restart: how long the cluster stays dead)
    shard: int | None = None  # lost_average: the local rank whose averager loses it (None: every rank's)
    start: float | None = None
    end: float | None = None
    note: str = ""
    skipped: bool = False
    armed: dict[str, int] = field(
        default_factory=dict
    )  # lost_average: launch number -> all-reduce number armed

    @property
    def fired(self) -> bool:
        return self.start is not None and self.end is not None

    def strike_mark(self, out: Path, launch: int) -> Path:
        """lost_average: where the armed fault module notes when it struck in launch ``launch``."""
        return out / f"lost_average{self.index}.launch{launch}.mark"

    def describe(self) -> str:
        where = f"cluster {self.cluster}" + (f" shard {self.shard}" if self.shard is not None else "")
        span = f" for {self.seconds:g} s" if self.seconds else ""
        return f"#{self.index} {self.kind} on {where} at outer step {self.trigger}{span}"

    def to_json(self) -> dict:
        return {**asdict(self), "fired": self.fired}


def split_sides(cluster: int, clusters: int) -> tuple[list[int], list[int]]:
    """A ``split`` on ``cluster``: its side is it and the next ranks up to half the galaxy (wrapping), the
    other side the rest: 2 | 2 of four. The side without the lowest rank has no quorum (``outer/quorum.py``'s
    tie-break): it holds, and takes the other side's state at the heal."""
    side = sorted((cluster + i) % clusters for i in range(clusters // 2))
    return side, [c for c in range(clusters) if c not in side]


def minority_of(fault: Fault, clusters: int, faults: list[Fault] = ()) -> list[int]:
    """The clusters a cut leaves without a quorum: the cut-off one, or a split's side with no majority of the
    clusters still in the galaxy (those that did not ``leave`` before it, of ``faults``), a tie going to the
    side with the lowest of them (``outer/quorum.py``'s tie-break)."""
    if fault.kind != "split":
        return [fault.cluster]
    gone = {f.cluster for f in faults if f.kind == "leave" and f.end is not None and f.end <= fault.start}
    side, other = ([c for c in part if c not in gone] for part in split_sides(fault.cluster, clusters))
    if len(side) != len(other):
        return side if len(side) < len(other) else other
    return other if min(side + other) in side else side


def _kinds_in_order(n: int, kinds: list[str], rng: random.Random) -> list[str]:
    """``n`` kinds: every allowed kind once before any repeats (shuffled rounds), a late joiner only first."""
    order = ["late_join"] if "late_join" in kinds and n else []
    others = [k for k in kinds if k != "late_join"]
    while len(order) < n and others:
        batch = others[:]
        rng.shuffle(batch)
        order += batch
    return order[:n]


def schedule(
    n: int,
    kinds: list[str],
    clusters: int,
    ranks: int,
    total_syncs: int,
    seed: int,
    durations: dict[str, float] | None = None,
) -> list[Fault]:
    """A seeded schedule of ``n`` faults over a run of ``total_syncs`` syncs per cluster. At most one lost
    average per cluster (the fault module takes one all-reduce number per launch); a kind that cannot be
    placed (a lost average when every cluster has one) gives way to the next kind of the order.
    ``durations``: seconds by kind, replacing :data:`DURATION_S`'s (a partition that outlasts a cluster's run,
    the case of the final-round rule)."""
    lasting = {**DURATION_S, **(durations or {})}
    rng = random.Random(seed)
    order = _kinds_in_order(n, kinds, rng)
    lo, hi = max(2, int(FIRST * total_syncs)), max(3, int(LAST * total_syncs))
    width = (hi - lo) / max(1, len(order))
    late = None
    faults: list[Fault] = []
    for i, kind in enumerate(order):
        trigger = int(lo + i * width + rng.uniform(0, width / 3))
        targets = [c for c in range(clusters) if c != late]
        if kind == "lost_average":
            targets = [c for c in targets if all(f.cluster != c or f.kind != kind for f in faults)]
            if not targets:
                kind = next((k for k in kinds if k not in ("lost_average", "late_join")), None)
                if kind is None:
                    break
                targets = [c for c in range(clusters) if c != late]
        if kind == "leave" and any(f.kind == "leave" for f in faults):  # one cluster leaves, at most
            kind = next(k for k in kinds if k not in ("leave", "late_join", "lost_average"))
        cluster = rng.choice(targets or list(range(clusters)))
        if kind == "late_join":
            cluster = late = rng.randrange(1, clusters) if clusters > 1 else 0
        shard = rng.randrange(ranks) if kind == "lost_average" and ranks > 1 else None
        faults.append(Fault(i, kind, cluster, max(2, trigger), lasting.get(kind, 0.0), shard))
    return faults
