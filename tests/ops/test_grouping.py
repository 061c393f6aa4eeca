"""The suite's ``xdist_group`` marks take effect: a group's tests run on one worker, one after another.

The WAN lab's tests rely on it (one lab at a time), and so do module fixtures meant to run once (the straight
galaxy run that tests/e2e/test_unequal_clusters.py's resume test replays, tests/dist/test_checkpoint.py's
straight run). pytest 9.2 made the mark silently do nothing: xdist tells its scheduler a test's group by
appending ``@group`` to the node id, and pytest 9.2's node ids no longer take that append
(pytest-dev/pytest-xdist#1386). The grouped tests were then spread over both workers and the fixtures ran
twice: ~70 s of a 22-minute suite, and two WAN labs at once. pyproject.toml pins pytest below 9.2; this test
says so when the pin is lifted too early."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

GROUPED = textwrap.dedent(
    """
    import os
    from pathlib import Path

    import pytest

    LOG = Path(__file__).with_name("log.txt")


    @pytest.fixture(scope="module")
    def once():
        with LOG.open("a") as log:
            log.write("fixture\\n")


    @pytest.mark.xdist_group("together")
    @pytest.mark.parametrize("case", range(3))
    def test_grouped(once, case):
        with LOG.open("a") as log:
            log.write(f"worker {os.environ['PYTEST_XDIST_WORKER']}\\n")


    @pytest.mark.parametrize("case", range(4))
    def test_free(case):
        pass
    """
)


def test_a_groups_tests_run_on_one_worker_and_its_module_fixture_once(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repo's config (its conftest, its markers)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = (tmp_path / "log.txt").read_text().splitlines()
    workers = {line for line in lines if line.startswith("worker")}
    assert lines.count("fixture") == 1 and len(workers) == 1, (
        f"xdist_group had no effect ({lines}): pytest {pytest.__version__} does not carry a test's group to "
        "xdist's scheduler (pytest-dev/pytest-xdist#1386); keep pytest below 9.2 (pyproject.toml's dev extra)"
    )
