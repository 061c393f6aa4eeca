"""How big ``open-diloco report``'s page gets and how long Chromium takes to open it, for a run of N rounds.

The run is the committed fixture (tests/fixtures/report: 3 clusters, 24 rounds, one partition) tiled N/24
times end to end: steps, outer steps and clocks shifted by the fixture's span each time, so the page has N
rounds of real records, a split every 24. Opening is timed as Chromium's headless ``--dump-dom`` of the page
(load, run its script, serialise the DOM), against the same for an empty page in the same run (Chromium's own
start-up).

    python scripts/bench/report_page.py --rounds 1000   # needs Debian's chromium (apt-get install chromium)

Figures: docs/results/report.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from open_diloco.report.page import write_page

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests/fixtures/report"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def tiled_run(out: Path, copies: int) -> None:
    """Each fixture file repeated ``copies`` times, every copy shifted past the previous one's steps, outer
    steps and clock; a ``start`` record only in the first copy (one launch per cluster)."""
    for source in sorted(FIXTURE.glob("*.jsonl")):
        records = [json.loads(line) for line in source.read_text().splitlines()]
        steps = max(r.get("step", 0) for r in records)
        rounds = max(r.get("outer_step", 0) for r in records)
        times = [r["time"] for r in records if "time" in r]
        span = max(times) - min(times) + 1.0
        with open(out / source.name, "w") as f:
            for copy in range(copies):
                for record in records:
                    if copy and record.get("event") == "start":
                        continue
                    shifted = dict(record)
                    for key, by in (("step", steps), ("outer_step", rounds), ("time", span)):
                        if isinstance(shifted.get(key), (int, float)):
                            shifted[key] += copy * by
                    f.write(json.dumps(shifted) + "\n")


def open_seconds(chromium: str, page: Path, repeats: int) -> float:
    """Median wall seconds of Chromium's ``--dump-dom`` of ``page``."""
    seconds = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as profile:
            started = time.perf_counter()
            subprocess.run(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                capture_output=True,
                timeout=120,
                check=True,
            )
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("report_page: no chromium on PATH: apt-get install chromium")
    with tempfile.TemporaryDirectory() as tmp:
        run, empty = Path(tmp) / "run", Path(tmp) / "empty.html"
        run.mkdir()
        tiled_run(run, max(1, -(-args.rounds // 24)))
        started = time.perf_counter()
        story, size = write_page([run], run / "report.html")
        built = time.perf_counter() - started
        empty.write_text("<!doctype html><title>empty</title>")
        baseline = open_seconds(chromium, empty, args.repeats)
        opened = open_seconds(chromium, run / "report.html", args.repeats)
    print(f"{story.summary[0]}")
    print(f"page {size / 1e6:.2f} MB, built in {built:.1f} s")
    print(
        f"chromium --dump-dom: page {opened:.2f} s, empty page {baseline:.2f} s "
        f"(page ÷ empty {opened / baseline:.2f}; the page's own share {opened - baseline:.2f} s)"
    )


if __name__ == "__main__":
    main()
