"""The chaos soak's --quick preset end to end (2 clusters x 1 rank on 127.0.0.1, one lost average): the soak
injects its fault, the galaxy heals, and every figure of the summary is computed from the run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(420)
def test_quick_soak_injects_a_lost_average_and_measures_its_repair(tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.chaos.soak", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    shown = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode in (0, 1), (
        shown
    )  # 1: a target failed, which is the trainer's verdict, not the soak's
    summary = json.loads((out / "summary.json").read_text())
    assert "| cluster |" in (out / "summary.md").read_text()
    assert summary["package_file"] == str(REPO / "open_diloco" / "__init__.py")
    assert not summary["hung"] and summary["left_running"] == [], shown
    clusters = summary["clusters"]
    assert len(clusters) == 2 and all(c["syncs"] >= 15 for c in clusters), shown  # 40 steps at H/P = 2: 20
    assert all(c["final_outer_step"] == 20 and c["final_param_hash"] for c in clusters), shown
    # goodput: the lost average's round is adopted, so no cluster's work is lost
    assert all(c["tokens_computed"] > 0 and 0.9 <= c["goodput"] <= 1.0 for c in clusters), shown
    assert "Galaxy goodput (tokens committed ÷ computed, every cluster): " in (out / "summary.md").read_text()
    (fault,) = summary["faults"]
    assert fault["kind"] == "lost_average" and fault["fired"] and fault["armed"] == {"1": 5}, shown
    assert "fault start #0 lost_average" in (out / "events.log").read_text()
    struck = [float(t) for t in (out / "lost_average0.launch1.mark").read_text().split()]
    assert fault["start"] == fault["end"] == struck[0], shown  # timed when the reducer's stream was cut
    assert fault["repaired"] and 1 <= fault["repair_syncs"] and fault["repair_seconds"] >= 0, shown
    assert set(fault["repair_by_cluster"]) == {"0", "1"}
    targets = {t["target"]: t for t in summary["acceptance"]}
    assert len(targets) == 12 and targets["nothing left running"]["passed"]
    ledger = targets["every cluster's ledger chain continuous, ending at its final θ"]
    assert ledger["passed"], ledger  # the lost average's round is adopted: the committer's entry, one chain
    assert targets["no hang (the global timeout)"]["passed"]
    assert summary["passed"] == all(t["passed"] for t in targets.values())
    assert proc.returncode == (0 if summary["passed"] else 1)
    # judged again from its files alone, the soak reads the same
    again = subprocess.run(
        [sys.executable, "-m", "scripts.chaos.soak", "--rejudge", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == proc.returncode, again.stdout[-2000:] + again.stderr[-2000:]
    rejudged = json.loads((out / "summary.json").read_text())
    assert rejudged["clusters"] == clusters and rejudged["faults"] == summary["faults"]
