"""``open-diloco report``: reading a run's metrics, judging its rounds, the page, and one line for bad input.

The fixture (tests/fixtures/report/) is a real 3-cluster galaxy whose cluster 2 lost its link after round 6
(scripts/report_fixture.py): apart, cluster 2 trained alone (rounds 7-15) while clusters 0 and 1 averaged as
two; once the link was back, clusters 0 and 1 re-synced to cluster 2's state at round 15 and all three
averaged together again from round 16.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from open_diloco.cli.app import run
from open_diloco.errors import ConfigError
from open_diloco.report.page import render
from open_diloco.report.runs import read_run
from open_diloco.report.story import outcome_of, tell
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "report"
CUT_OFF = 2


@pytest.fixture(scope="module")
def story():
    return tell(read_run([FIXTURE]))


def test_reads_three_clusters_of_one_run(story):
    assert [c.label for c in story.clusters] == ["cluster 0", "cluster 1", "cluster 2"]
    assert {c.run_id for c in story.clusters} == {"open_diloco"}
    assert story.rounds == list(range(1, 25))


def test_the_cut_off_cluster_is_apart_and_the_galaxy_heals(story):
    cells = story.cells
    apart = [r for r in story.rounds if cells[(CUT_OFF, r)].apart]
    assert apart and min(apart) == 7, apart
    assert all(cells[(CUT_OFF, r)].in_sync is False for r in apart)
    # the two that kept averaging skipped the rounds cluster 2 ran ahead by, then re-synced to it
    assert {cells[(0, r)].outcome for r in (13, 14)} == {"absent"}
    assert cells[(0, 15)].outcome == cells[(1, 15)].outcome == "resynced"
    (split,) = story.splits
    assert (split.first, split.last, split.healed_round) == (7, 15, 16)
    assert split.apart == [CUT_OFF] and split.missed == [0, 1]
    assert split.seconds > 0 and split.heal_seconds is not None and 0 <= split.heal_seconds < split.seconds


def test_summary_names_the_longest_split_and_the_final_agreement(story):
    text = " ".join(story.summary)
    assert "3 clusters" in text and "24 rounds" in text
    assert "rounds 7–15" in text
    assert "all clusters agree at round 24" in text


def test_outcome_of_an_older_trainers_record():
    assert outcome_of({"round_outcome": "adopted"}) == "adopted"
    assert outcome_of({"round_outcome": "held"}) == "held"  # no quorum (outer/quorum.py)
    assert outcome_of({"resynced": True}) == "resynced"
    assert outcome_of({"pseudo_grad_finite": False}) == "sat_out"
    assert outcome_of({"outer_step": 3}) == "applied"


def test_page_is_self_contained_and_marks_every_cell(story):
    html = render(story, ["a.jsonl"])
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "the page must not fetch anything"
    cells = re.findall(
        r'data-cluster="(\d)" data-round="(\d+)" data-outcome="(\w+)" data-galaxy="(\w+)"', html
    )
    assert ("2", "7", "applied", "apart") in cells
    assert ("0", "15", "resynced", "with") in cells
    assert ("0", "13", "absent", "absent") in cells
    for chart in ("loss-step", "loss-time", "val_loss-step", "allreduce_seconds", "bytes_sent"):
        assert f'id="{chart}"' in html


def _fail_line(argv: list[str], capsys) -> str:
    assert run(["report", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1, err
    return err


def test_a_directory_without_metrics_is_one_line(tmp_path, capsys):
    assert "holds no metrics" in _fail_line([str(tmp_path)], capsys)


def test_a_truncated_file_is_one_line(tmp_path, capsys):
    text = (FIXTURE / "cluster0.jsonl").read_text()
    (tmp_path / "cluster0.jsonl").write_text(text[: len(text) - 40])
    assert "truncated" in _fail_line([str(tmp_path)], capsys)


def _copy_as_run(source: Path, target: Path, run_id: str, shift: float = 0.0) -> None:
    lines = []
    for line in source.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            record["config"]["hv"]["run_id"] = run_id
        record["time"] += shift
        lines.append(json.dumps(record))
    target.write_text("\n".join(lines) + "\n")


def test_two_runs_are_one_line(tmp_path, capsys):
    shutil.copy(FIXTURE / "cluster0.jsonl", tmp_path / "cluster0.jsonl")
    _copy_as_run(FIXTURE / "cluster1.jsonl", tmp_path / "cluster1.jsonl", "another")
    assert "different runs" in _fail_line([str(tmp_path)], capsys)


def test_two_runs_of_the_default_run_id_are_told_apart(tmp_path):
    # the same cluster twice, or a run a day later under the same --hv.run-id
    shutil.copy(FIXTURE / "cluster0.jsonl", tmp_path / "a.jsonl")
    shutil.copy(FIXTURE / "cluster0.jsonl", tmp_path / "b.jsonl")
    with pytest.raises(ConfigError, match="both galaxy rank 0"):
        read_run([tmp_path])
    (tmp_path / "b.jsonl").unlink()
    _copy_as_run(FIXTURE / "cluster1.jsonl", tmp_path / "b.jsonl", "open_diloco", shift=86400)
    with pytest.raises(ConfigError, match="two different runs"):
        read_run([tmp_path])


def test_writes_the_page_beside_the_metrics(tmp_path, capsys):
    for path in FIXTURE.glob("*.jsonl"):
        shutil.copy(path, tmp_path / path.name)
    assert run(["report", str(tmp_path)]) == 0
    page = tmp_path / "report.html"
    assert page.stat().st_size < 300_000
    assert "report.html" in capsys.readouterr().out
