"""The quality yardstick's own arithmetic (scripts/bench/convergence_arms.py)."""

from __future__ import annotations

import math

import pytest
import torch

from scripts.bench.convergence_arms import drift


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
