"""``open-diloco report RUN_DIR_OR_METRICS...``: one self-contained HTML page of what a run did."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from cyclopts import Parameter


def report(
    inputs: Annotated[list[Path], Parameter(name="RUN_DIR_OR_METRICS", consume_multiple=True)],
    /,
    *,
    output: Annotated[Path | None, Parameter(name=["--output", "-o"])] = None,
) -> None:
    """Write one HTML page (no server, no network) telling what a galaxy's run did, from its clusters' jsonl
    metrics: which clusters were in each round, splits and heals, retries, re-syncs and sat-out rounds, sync
    seconds and bytes, each cluster's busy share and loss.

    Parameters
    ----------
    inputs
        A run's directory (its *.jsonl metrics, searched below it when none is at its top) or the clusters'
        metrics files (--metrics-path), all of one run.
    output
        The page to write. Default: report.html in the run's directory (beside the first file given).
    """
    from open_diloco.report.page import write_page

    first = inputs[0]
    target = output or (first if first.is_dir() else first.parent) / "report.html"
    story, size = write_page(inputs, target, name=_shown)
    print(f"{target} ({size / 1e6:.2f} MB): {story.summary[0]}")


def _shown(path: Path) -> str:
    """``path`` as the page names it: relative to the working directory when below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
