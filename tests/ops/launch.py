"""Running scripts/cluster_train.sh from tests: environment, a torchrun spy, and process bookkeeping."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid
from pathlib import Path

from tests.conftest import REPO, TINY_MODEL, trainer_env

SCRIPT = REPO / "scripts" / "cluster_train.sh"
BIN = Path(sys.executable).parent


def write_config(path: Path, extra: str = "") -> Path:
    """The small fake-data config of the launcher tests (absolute model path: tests run in tmp dirs)."""
    path.write_text(
        f'path_model = "{TINY_MODEL}"\nfake_data = true\nseq_length = 128\nper_device_train_batch_size = 4\n'
        f"total_batch_size = 8\nmax_steps = 3\ntorch_compile = false\nnum_workers = 0\n{extra}"
    )
    return path


def launcher_env(tmp_path: Path, **extra: str) -> tuple[dict[str, str], Path]:
    """Environment for the script, and the marker file a `torchrun` spy on PATH creates when it is started.

    The spy comes first on PATH and execs the real torchrun, so a test can tell whether the script ever
    started torchrun. Every process gets a unique tag in its environment, which :func:`tagged_pids` finds
    even after torchrun moved its workers into sessions of their own."""
    spy_dir = tmp_path / "spy"
    spy_dir.mkdir(exist_ok=True)
    marker = tmp_path / "torchrun-started"
    spy = spy_dir / "torchrun"
    spy.write_text(f'#!/bin/sh\ntouch "{marker}"\nexec "{BIN / "torchrun"}" "$@"\n')
    spy.chmod(0o755)
    env = trainer_env()
    env.pop("VENV", None)
    env.pop("CONDA_ENV", None)
    env.update(
        PATH=f"{BIN}:{env.get('PATH', '')}",
        NPROC_PER_NODE="1",
        BACKEND="gloo",
        PREFLIGHT_TIMEOUT="3",
        RDZV_TIMEOUT="120",
    )
    env.update(extra)
    env.update(PATH=f"{spy_dir}:{env['PATH']}", OPEN_DILOCO_TEST_TAG=uuid.uuid4().hex)
    return env, marker


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries ``OPEN_DILOCO_TEST_TAG=tag``."""
    needle = f"OPEN_DILOCO_TEST_TAG={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
    return found


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every tagged process by PID; return the ones that were still there."""
    left = tagged_pids(tag)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left
