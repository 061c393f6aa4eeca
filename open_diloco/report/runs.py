"""Reading a run's metrics for a report: each cluster's jsonl file, checked to be whole and of one run.

A run is what the report can tell a story about, so anything else is refused with one line naming the file and
the fix: no metrics at all, a file cut off mid-record (a copy that stopped, a full disk), or files of two runs
(another ``--hv.run-id``, or two files claiming one cluster). Only the keys docs/configuration.md promises are
read; a key a file lacks (an older trainer) is simply not shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from open_diloco.errors import ConfigError


@dataclass
class ClusterMetrics:
    """One cluster's records: ``steps`` (every per-step record, in file order) and ``syncs`` (those with an
    ``outer_step``), with who it is as its ``start`` records say."""

    path: Path
    name: str
    galaxy_rank: int | None
    run_id: str | None
    launches: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    syncs: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    span: tuple[float, float] = (0.0, 0.0)
    """First and last ``time`` of its records (Unix seconds)."""

    @property
    def label(self) -> str:
        """How the page names the cluster: its galaxy rank where it has one (the word operators use)."""
        return f"cluster {self.galaxy_rank}" if self.galaxy_rank is not None else self.name


def metrics_files(inputs: list[Path]) -> list[Path]:
    """The jsonl files ``inputs`` name: a file as given, a directory's ``*.jsonl`` (searched below it when it
    has none at its top, as a soak's output keeps them beside logs)."""
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            found = sorted(path.glob("*.jsonl")) or sorted(path.rglob("*.jsonl"))
            if not found:
                raise ConfigError(
                    f"{path} holds no metrics (*.jsonl): give the run's directory, or the files of "
                    "--metrics-path (each cluster's rank 0 writes one with --metric-logger-type jsonl)"
                )
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"{path} does not exist: give a run's directory or its clusters' metrics files")
    return list(dict.fromkeys(path.resolve() for path in files))


def read_cluster(path: Path) -> ClusterMetrics:
    """One metrics file, every line a whole JSON object; raise :class:`ConfigError` on the first that is
    not."""
    text = path.read_text(encoding="utf-8", errors="replace")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            where = "its last line is" if number == len(text.splitlines()) else f"line {number} is"
            raise ConfigError(
                f"{path}: {where} not a whole JSON record (the file is truncated or corrupt): copy it again "
                "once its cluster has finished the step it was writing"
            ) from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: line {number} is not a metrics record: is this open-diloco metrics?")
        records.append(record)
    starts = [rec for rec in records if rec.get("event") == "start"]
    steps = [rec for rec in records if "step" in rec and rec.get("event") != "start"]
    if not steps:
        raise ConfigError(
            f"{path} holds no step records: not open-diloco metrics, or its cluster never finished a step"
        )
    run_ids = {_hv(rec).get("run_id") for rec in starts} - {None}
    ranks = {_hv(rec).get("world_rank") for rec in starts if _hv(rec)} - {None}
    if len(run_ids) > 1 or len(ranks) > 1:
        raise ConfigError(
            f"{path} holds launches of different runs (run ids {sorted(run_ids)}, galaxy ranks "
            f"{sorted(ranks)}): "
            "give each run's metrics its own file (--metrics-path)"
        )
    last_start = starts[-1] if starts else {}
    times = [rec["time"] for rec in steps if isinstance(rec.get("time"), (int, float))]
    return ClusterMetrics(
        path=path,
        name=str(last_start.get("run_name") or path.stem),
        galaxy_rank=next(iter(ranks), None),
        run_id=next(iter(run_ids), None),
        launches=max(1, len(starts)),
        steps=steps,
        syncs=[rec for rec in steps if "outer_step" in rec],
        config=last_start.get("config") or {},
        span=(min(times), max(times)) if times else (0.0, 0.0),
    )


def _hv(start: dict[str, Any]) -> dict[str, Any]:
    config = start.get("config") or {}
    return config.get("hv") or {}


def read_run(inputs: list[Path]) -> list[ClusterMetrics]:
    """The clusters of one run, ordered by galaxy rank; raise :class:`ConfigError` unless ``inputs`` hold
    exactly one run's metrics."""
    clusters = [read_cluster(path) for path in metrics_files(inputs)]
    if not clusters:
        raise ConfigError("no metrics given: name a run's directory or its clusters' metrics files")
    run_ids = {c.run_id for c in clusters} - {None}
    if len(run_ids) > 1:
        by_run = {
            run_id: next(c.path.name for c in clusters if c.run_id == run_id) for run_id in sorted(run_ids)
        }
        raise ConfigError(
            "these metrics are of different runs ("
            + ", ".join(f"{path} is --hv.run-id {run_id}" for run_id, path in by_run.items())
            + "): report one run at a time"
        )
    seen: dict[int, Path] = {}
    for cluster in clusters:
        if cluster.galaxy_rank is None:
            continue
        if cluster.galaxy_rank in seen:
            raise ConfigError(
                f"{seen[cluster.galaxy_rank]} and {cluster.path} are both galaxy rank {cluster.galaxy_rank}: "
                "metrics of two different runs (or one file copied twice); report one run at a time"
            )
        seen[cluster.galaxy_rank] = cluster.path
    _check_overlap(clusters)
    return sorted(clusters, key=lambda c: (c.galaxy_rank is None, c.galaxy_rank or 0, c.name))


def _check_overlap(clusters: list[ClusterMetrics]) -> None:
    """Clusters of one run train at the same time: two whose records never overlap in time are two runs
    (the default ``--hv.run-id`` is shared by every run that keeps it)."""
    ordered = sorted(clusters, key=lambda c: c.span[0])
    latest_end, latest = ordered[0].span[1], ordered[0]
    for cluster in ordered[1:]:
        if cluster.span[0] > latest_end:
            raise ConfigError(
                f"{latest.path} ends before {cluster.path} begins: metrics of two different runs "
                "(clusters of one galaxy train at the same time); report one run at a time"
            )
        if cluster.span[1] > latest_end:
            latest_end, latest = cluster.span[1], cluster
