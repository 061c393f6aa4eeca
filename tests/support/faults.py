"""The environment that puts one of ``tests/e2e/faults``' ``sitecustomize`` modules in a cluster's
trainers: a fault (or a pace) for the clusters a test starts with it, and no other process."""

from __future__ import annotations

import os
from pathlib import Path

FAULTS = Path(__file__).parents[1] / "e2e" / "faults"


def fault_env(fault: str, **variables: object) -> dict[str, str]:
    """``PYTHONPATH`` with ``faults/<fault>`` first (the caller's path after it), and ``variables`` (the
    fault's ``OPEN_DILOCO_TEST_*`` settings) as strings."""
    search_path = [str(FAULTS / fault), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(search_path), **{k: str(v) for k, v in variables.items()}}


def paced(step_seconds: float) -> dict[str, str]:
    """Clusters whose every inner step takes at least ``step_seconds`` (``faults/paced_steps``): alive and in
    rounds, without training flat out beside what the test runs."""
    return fault_env("paced_steps", OPEN_DILOCO_TEST_STEP_SECONDS=step_seconds)
