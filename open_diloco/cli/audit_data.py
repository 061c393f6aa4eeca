"""``open-diloco audit-data SAMPLE_LOG_DIR METRICS...``: what became of every page of data the clusters read
(``open_diloco/data_audit.py``); ``--verify`` exits 1 on the first page lost or taken twice."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

from cyclopts import Parameter

from open_diloco.errors import ConfigError, OpenDilocoError


def audit_data(
    sample_log: Annotated[Path, Parameter(name="SAMPLE_LOG_DIR")],
    metrics: Annotated[list[Path], Parameter(name="METRICS", consume_multiple=True)],
    /,
    *,
    verify: bool = False,
    json_output: Annotated[bool, Parameter(name="--json")] = False,
) -> None:
    """Check the galaxy's data from what the loaders read: each cluster's pages (one inner step's samples)
    committed into θ_outer once, lost (a held stride, a take, a launch that died, a dropped fork, pages a take
    skipped) or taken twice, and (real data) samples two clusters committed.

    Parameters
    ----------
    sample_log
        The --sample-log directory the clusters wrote.
    metrics
        The clusters' jsonl metrics files (--metrics-path), one per cluster, or the run's directory.
    verify
        Exit 1 with one line on the first cluster with a page lost or taken twice.
    json_output
        Print each cluster's pages as one JSON object per line instead of the table.
    """
    from open_diloco.data_audit import audit
    from open_diloco.report.runs import metrics_files

    if not sample_log.is_dir():
        raise ConfigError(f"{sample_log} is not a directory: give the --sample-log directory of the run")
    galaxy = audit(sample_log, metrics_files(metrics))
    if not galaxy.clusters:
        raise ConfigError("no start record in the metrics files: give --metric-logger-type jsonl files")
    for cluster in galaxy.clusters:
        if json_output:
            print(json.dumps(asdict(cluster)))
        else:
            print(
                f"cluster {cluster.galaxy_rank}: {cluster.read if galaxy.dealt else cluster.cursor} pages"
                f"{' read' if galaxy.dealt else ''}, {len(cluster.once)} committed once, "
                f"{len(cluster.lost)} lost ({len(cluster.skipped)} never read), {len(cluster.twice)} twice, "
                f"{len(cluster.in_flight)} in flight at the end"
                + (f"; lost: {why}" if (why := _causes(cluster.causes)) else "")
            )
    if (dealt := galaxy.dealt) is not None:
        if json_output:
            print(json.dumps({"galaxy": asdict(dealt)}))
        else:
            print(
                f"the galaxy (pages dealt by the ledger): {dealt.cursor} dealt, {dealt.once} committed once, "
                f"{len(dealt.lost)} lost, {len(dealt.twice)} twice, {len(dealt.in_flight)} in flight at the "
                f"end, {len(dealt.unmatched)} the ledger and the readings disagree on; "
                f"{len(dealt.fragment_twice)} taken twice by a fragment (partly committed, then again)"
            )
    problems = galaxy.problems
    if problems and verify:
        raise DataCheckFailed(problems[0])
    for problem in problems:
        print(f"problem: {problem}")


def _causes(causes: dict[str, int]) -> str:
    return ", ".join(f"{count} {why}" for why, count in sorted(causes.items(), key=lambda kv: -kv[1]))


class DataCheckFailed(OpenDilocoError):
    """``open-diloco audit-data --verify`` found a page lost or taken twice: one line, exit 1."""
