"""The quality yardstick's own arithmetic (scripts/bench/convergence_arms.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from scripts.bench.convergence_arms import drift
from tests.conftest import REPO


@pytest.mark.parametrize("clusters", [2, 3, 4])
def test_drift_is_the_norm_of_the_std_over_clusters(clusters):
    generator = torch.Generator().manual_seed(clusters)
    locals_ = [torch.randn(10_001, generator=generator) * (m + 1) for m in range(clusters)]
    expected = float(torch.stack(locals_).double().std(0).norm())
    assert drift(locals_) == pytest.approx(expected, rel=1e-6)


def test_equal_clusters_have_no_drift():
    theta = torch.randn(4096)
    assert drift([theta.clone(), theta.clone()]) == 0.0


def test_one_cluster_has_no_drift_to_measure():
    assert math.isnan(drift([torch.randn(16)]))


def test_an_arm_with_a_slower_cluster_runs_end_to_end(tmp_path):
    """The yardstick itself, tiny (4 steps of 32 tokens on this repo's own sources): an arm with a cluster at
    half speed (``slow``) runs as many more galaxy steps as keep its tokens those of two full-speed clusters,
    and a cluster alone runs the steps it is given. Keeps the bench in step with the trainer's API."""
    out = tmp_path / "arms.jsonl"
    command = [
        sys.executable,
        str(REPO / "scripts/bench/convergence.py"),
        "--arms",
        "diloco:M=2,H=2,slow=0.5 half:M=2,steps=3",
        "--steps",
        "4",
        "--seq-length",
        "32",
        "--batch",
        "4",
        "--seeds",
        "0",
        "--eval-samples",
        "4",
        "--dataset-path",
        str(REPO / "open_diloco/outer/*.py"),
        "--data-cache-dir",
        str(tmp_path / "cache"),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    arms = {record["arm"]: record for record in map(json.loads, out.read_text().splitlines())}
    assert arms["diloco:M=2,H=2,slow=0.5"]["steps"] == 5  # round(4 * 2 / 1.5)
    assert arms["half:M=2,steps=3"]["steps"] == 3
    assert all(
        record["disjoint"] and math.isfinite(record["val"]["5" if "slow" in arm else "3"])
        for arm, record in arms.items()
    )
