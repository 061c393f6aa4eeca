"""Shared test helpers: where the repo is, how to run the trainer, and process bookkeeping."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from open_diloco import processes

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "tests" / "models" / "llama-2m-fresh"
TRAIN_SCRIPT = REPO / "open_diloco" / "train_fsdp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    """A TCP port nobody listens on right now (127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_metrics(path: Path) -> list[dict]:
    """The per-step records of a jsonl metrics file (the `start` record excluded)."""
    return [rec for rec in map(json.loads, Path(path).read_text().splitlines()) if "step" in rec]


def trainer_env() -> dict[str, str]:
    """Environment of spawned trainers: quiet, offline, one thread per rank on the 2-core CI machine."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


@pytest.fixture
def tiny_model() -> Path:
    return TINY_MODEL


def kill_tree(pid: int, sig: int = signal.SIGKILL, timeout: float = 20.0) -> None:
    """Send ``sig`` to ``pid`` and every descendant, by PID; assert all are gone within ``timeout``."""
    left = processes.kill_tree(pid, sig, timeout)
    assert not left, f"processes still alive after signal {sig}: {left}"


def with_overrides(defaults: list[str], extra: tuple[str, ...] | list[str]) -> list[str]:
    """``defaults`` (flag/value pairs) followed by ``extra``, dropping each default flag that ``extra`` sets
    again (the CLI refuses a flag given twice)."""
    base = list(defaults)
    for flag in {arg for arg in extra if arg.startswith("--")} & set(base):
        at = base.index(flag)
        del base[at : at + 2]
    return [*base, *extra]
