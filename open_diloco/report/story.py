"""Judging a run's rounds for the report: what each round was for each cluster, where the galaxy split and how
long it took to heal, and the few figures an operator reads first.

A round's *main* state is the θ_outer hash most of its clusters hold after it (clusters that averaged
together hold bitwise-identical weights): a cluster with another hash trained *apart* that round (its side of
a partition, or a fork). A round is *whole* when every cluster that was running then recorded it, in sync,
with the main hash; a *split* is a run of rounds that are not whole, and it heals at the next whole round.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from open_diloco.report.runs import ClusterMetrics

OUTCOMES = ("applied", "adopted", "resynced", "sat_out", "held", "absent")
"""What a round was for a cluster (the metrics' ``round_outcome``, and ``absent``: no record of the round)."""


@dataclass
class Cell:
    """One cluster's part in one round: the timeline's cell."""

    cluster: int
    round: int
    outcome: str
    attempt: int = 0
    in_sync: bool | None = None
    apart: bool = False
    peers: int | None = None
    alive: int | None = None
    state_source: int | None = None
    param_hash: str | None = None
    time: float | None = None


@dataclass
class Split:
    """Rounds ``first`` … ``last`` that were not whole; ``healed_round``: the next whole one (None: the run
    ended split). ``apart``: clusters that held another state than the main one in some round of it;
    ``missed``: clusters absent from, re-synced in or sitting out some round of it. Seconds are between the
    whole rounds around it (``began``: when the last whole one ended); ``heal_seconds`` from the first record
    that saw every cluster alive again to the healed round."""

    first: int
    last: int
    apart: list[int]
    missed: list[int]
    healed_round: int | None
    seconds: float | None
    heal_seconds: float | None
    began: float | None = None

    @property
    def rounds(self) -> int:
        return self.last - self.first + 1


@dataclass
class Story:
    """Everything the page shows, judged: the cells by (cluster, round), the splits, and the summary lines."""

    clusters: list[ClusterMetrics]
    rounds: list[int]
    cells: dict[tuple[int, int], Cell]
    splits: list[Split]
    summary: list[str] = field(default_factory=list)
    started: float = 0.0


def outcome_of(record: dict[str, Any]) -> str:
    """A sync record's outcome: its ``round_outcome``, or for an older trainer's record what its other keys
    say."""
    if record.get("round_outcome") in OUTCOMES:
        return record["round_outcome"]
    if record.get("resynced"):
        return "resynced"
    if record.get("pseudo_grad_finite") is False or record.get("pseudo_grad_in_bound") is False:
        return "sat_out"
    return "applied"


def build_cells(clusters: list[ClusterMetrics]) -> tuple[list[int], dict[tuple[int, int], Cell]]:
    """Every round any cluster recorded, and a cell per (cluster, round) within each cluster's lifetime (its
    first to last sync): a round it has no record of there is ``absent``. A round recorded twice (a retry
    logged again after a restart, a held round taken later) counts by its last record."""
    cells: dict[tuple[int, int], Cell] = {}
    for index, cluster in enumerate(clusters):
        for record in cluster.syncs:
            attempt = record.get("attempt", record.get("retries")) or 0
            outcome = outcome_of(record)
            number = record["outer_step"] + (outcome == "held")  # a held round produced no outer step
            cells[(index, number)] = Cell(
                cluster=index,
                round=number,
                outcome=outcome,
                attempt=int(attempt),
                in_sync=record.get("in_sync"),
                peers=record.get("galaxy_peers"),
                alive=record.get("galaxy_alive"),
                state_source=record.get("state_source"),
                param_hash=record.get("param_hash"),
                time=record.get("time"),
            )
    rounds = sorted({r for _, r in cells})
    recorded = set(rounds)
    for index in range(len(clusters)):
        own = [r for (c, r) in cells if c == index]
        lifetime = range(min(own) + 1, max(own)) if own else range(0)
        for r in lifetime:
            if r in recorded and (index, r) not in cells:
                cells[(index, r)] = Cell(cluster=index, round=r, outcome="absent")
    _mark_apart(cells)
    return rounds, cells


def by_round(cells: dict[tuple[int, int], Cell]) -> dict[int, list[Cell]]:
    """The cells of each round, by cluster."""
    grouped: dict[int, list[Cell]] = {}
    for cell in sorted(cells.values(), key=lambda c: (c.round, c.cluster)):
        grouped.setdefault(cell.round, []).append(cell)
    return grouped


def _mark_apart(cells: dict[tuple[int, int], Cell]) -> None:
    """Flag the cells whose hash is not the round's main one (ties go to the lowest-ranked cluster's hash)."""
    for round_cells in by_round(cells).values():
        held = [c for c in round_cells if c.param_hash]
        counts = Counter(c.param_hash for c in held)
        if len(counts) < 2:
            continue
        top = max(counts.values())
        main = next(c.param_hash for c in held if counts[c.param_hash] == top)
        for cell in held:
            cell.apart = cell.param_hash != main


def is_whole(cells: list[Cell]) -> bool:
    """A round every running cluster recorded in sync, all on the main state."""
    return all(c.outcome != "absent" and c.in_sync is not False and not c.apart for c in cells)


def find_splits(rounds: list[int], cells: dict[tuple[int, int], Cell], size: int) -> list[Split]:
    """The runs of rounds that were not whole, each with the round and seconds it took to heal."""
    grouped = by_round(cells)
    splits: list[Split] = []
    current: list[int] = []
    for r in [*rounds, None]:
        if r is not None and not is_whole(grouped[r]):
            current.append(r)
            continue
        if current:
            splits.append(_split(current, r, grouped, size, rounds))
            current = []
    return splits


def _split(
    bad: list[int], healed: int | None, by_round: dict[int, list[Cell]], size: int, rounds: list[int]
) -> Split:
    inside = [c for r in bad for c in by_round[r]]
    apart = sorted({c.cluster for c in inside if c.apart})
    missed = sorted({c.cluster for c in inside if c.outcome in ("absent", "resynced", "sat_out", "held")})
    before = [r for r in rounds if r < bad[0]]
    start = _round_time(by_round[before[-1]]) if before else None
    end = _round_time(by_round[healed]) if healed is not None else None
    seconds = end - start if start is not None and end is not None else None
    dropped = next((i for i, c in enumerate(sorted(inside, key=_when)) if (c.alive or size) < size), None)
    heal_seconds = None
    if end is not None and dropped is not None:
        later = sorted(inside, key=_when)[dropped:]
        back = next((c.time for c in later if c.alive is not None and c.alive >= size and c.time), None)
        heal_seconds = end - back if back is not None else None
    return Split(bad[0], bad[-1], apart, missed, healed, seconds, heal_seconds, began=start)


def _when(cell: Cell) -> float:
    return cell.time or 0.0


def _round_time(cells: list[Cell]) -> float | None:
    """When a round ended for the galaxy: its last cluster's record."""
    times = [c.time for c in cells if c.time is not None]
    return max(times) if times else None


def tell(clusters: list[ClusterMetrics]) -> Story:
    """Judge ``clusters`` (one run's, from :func:`~open_diloco.report.runs.read_run`)."""
    rounds, cells = build_cells(clusters)
    size = max([len(clusters)] + [c.alive or 0 for c in cells.values()])
    story = Story(clusters, rounds, cells, find_splits(rounds, cells, size))
    story.started = min(c.span[0] for c in clusters)
    story.summary = summarize(story)
    return story


def summarize(story: Story) -> list[str]:
    """The lines on top of the page: who, how long, how often apart, and whether the clusters ended as one."""
    clusters, cells = story.clusters, story.cells.values()
    last_step = max(rec["step"] for c in clusters for rec in c.steps)
    hours = (max(c.span[1] for c in clusters) - story.started) / 3600
    counts = Counter(c.outcome for c in cells)
    retried = sum(1 for c in cells if c.attempt > 0)
    lines = [
        f"{len(clusters)} clusters ({', '.join(c.label for c in clusters)}), {len(story.rounds)} rounds, "
        f"{last_step} steps in {_duration(hours * 3600)}.",
        f"Rounds by outcome over all clusters: {counts['applied']} applied, {counts['adopted']} adopted, "
        f"{counts['resynced']} re-synced, {counts['sat_out']} sat out, {counts['held']} held (no quorum), "
        f"{counts['absent']} absent; "
        f"{retried} needed a retry.",
    ]
    if story.splits:
        longest = max(story.splits, key=lambda s: (s.rounds, s.seconds or 0))
        lines.append(
            f"{len(story.splits)} split(s); the longest out-of-sync run: "
            f"rounds {longest.first}–{longest.last} "
            f"({longest.rounds} rounds{_seconds_text(longest.seconds)}), "
            + (
                f"healed at round {longest.healed_round}."
                if longest.healed_round
                else "not healed by the end."
            )
        )
    else:
        lines.append("No split: every round was whole (every cluster in sync on one state).")
    lines.append(final_agreement(story))
    return lines


def final_agreement(story: Story) -> str:
    """Whether the clusters' last recorded θ_outer hashes agree (a galaxy that ended as one model)."""
    last = [(c.label, c.syncs[-1]) for c in story.clusters if c.syncs]
    if not last:
        return "No cluster recorded a round."
    hashes = {rec.get("param_hash") for _, rec in last}
    steps = {rec["outer_step"] for _, rec in last}
    if len(hashes) == 1 and len(steps) == 1:
        return f"Final θ hash: all clusters agree at round {steps.pop()} ({hashes.pop()})."
    ends = "; ".join(f"{label}: round {rec['outer_step']} {rec.get('param_hash')}" for label, rec in last)
    return f"Final θ hash: the clusters DISAGREE ({ends})."


def _seconds_text(seconds: float | None) -> str:
    return f", {_duration(seconds)}" if seconds is not None else ""


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
