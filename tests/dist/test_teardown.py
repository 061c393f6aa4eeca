"""A finished run ends its process group's backend before the interpreter's teardown (real torchrun, gloo)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_MODEL, TORCHRUN, TRAIN_SCRIPT, trainer_env

pytestmark = pytest.mark.dist

PROBE = Path(__file__).with_name("exit_threads_probe.py")


def test_a_finished_run_leaves_no_gloo_thread_to_the_interpreters_teardown(tmp_path):
    """Before the fix, DTensor's caches kept the device mesh, and so the gloo backend, alive past
    ``destroy_process_group``: 3 gloo threads per rank were still running after every exit hook, and the
    interpreter's teardown could abort the process with SIGABRT (once in CI, in ~hundreds of runs)."""
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        str(PROBE),
        str(tmp_path),
        str(TRAIN_SCRIPT),
        "--path-model",
        str(TINY_MODEL),
        "--fake-data",
        "--no-torch-compile",
        "--seq-length",
        "64",
        "--num-workers",
        "0",
        "--max-steps",
        "3",
        "--total-batch-size",
        "8",
        "--per-device-train-batch-size",
        "4",
    ]
    done = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        names = json.loads((tmp_path / f"threads-{rank}.json").read_text())
        assert names and not [name for name in names if "gloo" in name], (rank, names)
