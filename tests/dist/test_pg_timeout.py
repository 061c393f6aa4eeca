"""A round longer than the process-group timeout's floor does not kill the cluster: the trainer's timeout is
derived from the galaxy's flags (issue 34, point 5), shown under real torchrun with a short floor standing in
for 600 s."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, TORCHRUN, kill_tree, trainer_env
from tests.dist.pg_timeout_probe import FLOOR, HV, WAIT

pytestmark = pytest.mark.dist

PROBE = Path(__file__).with_name("pg_timeout_probe.py")


def test_a_rank_waiting_past_the_floor_in_a_collective_survives_on_the_derived_timeout(tmp_path):
    assert HV.averaging_timeout > FLOOR and FLOOR < WAIT  # a wait the flags allow, longer than the floor
    proc = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(PROBE), str(tmp_path)],
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert rank0["timeout"] == rank1["timeout"] > WAIT
    floor_seconds, floor_error = rank1["floor_only"]
    assert floor_error is not None and floor_seconds < WAIT, (
        rank1
    )  # the floor alone: the cluster would have died
    for rank in (rank0, rank1):
        assert rank["derived"][1] is None, rank  # the derived timeout: the collective completed
    assert (
        rank1["floor_only"][0] + rank1["derived"][0] >= WAIT - 0.5
    )  # rank 1 sat in collectives the whole wait
