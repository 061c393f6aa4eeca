"""Warnings from every rank reach the cluster's log with time, galaxy rank, rank and local rank; rank 0's
per-step line is unchanged."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_MODEL, TORCHRUN, kill_tree, trainer_env

pytestmark = pytest.mark.dist

PROBE = Path(__file__).with_name("warning_probe.py")


def test_a_warning_on_local_rank_1_reaches_the_log_with_its_ranks():
    flags = [
        "--path-model",
        str(TINY_MODEL),
        "--fake-data",
        "--no-torch-compile",
        "--seq-length",
        "32",
        "--per-device-train-batch-size",
        "2",
        "--total-batch-size",
        "4",
        "--max-steps",
        "3",
        "--num-workers",
        "0",
    ]
    proc = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(PROBE), *flags],
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if "probe: a warning on local rank 1" in line]
    assert len(ours) == 1, stderr[-3000:]
    # time, level, galaxy rank, rank, local rank, then where it came from and what it said
    assert re.fullmatch(
        r"(\[rank1\]:)?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARN(ING)? "
        r"galaxy_rank=0 rank=1 local_rank=1 py\.warnings: "
        r".*warning_probe\.py:\d+: UserWarning: probe: a warning on local rank 1",
        ours[0],
    ), ours[0]
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert [line.split("|")[0].split()[1] for line in steps] == [
        "1/3",
        "2/3",
        "3/3",
    ]  # rank 0 only, as before
