"""Shared test helpers: where the repo is, how to run the trainer, and process bookkeeping."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

# The helpers benchmarks share live in the package (open_diloco/local_galaxy.py); tests import them from here.
from open_diloco.local_galaxy import (  # noqa: F401
    REPO,
    SHALLOW_MODEL,
    TINY_MODEL,
    TORCHRUN,
    TRAIN_SCRIPT,
    kill_tree,
    read_metrics,
    trainer_env,
    with_overrides,
)


def free_port() -> int:
    """A TCP port nobody listens on right now (127.0.0.1)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def tiny_model() -> Path:
    return TINY_MODEL


RUN_FIRST = ("wan", "e2e", "dist", "ops", "unit")
"""The order the levels are handed to the workers: the longest tests (and the WAN lab's group, which one
worker runs end to end) first, the unit tests' seconds last, where they fill whatever a worker has left while
the other finishes its last long test. Within a level, collection order."""


LONG_UNIT = ("test_quality_guard.py",)
"""Unit tests of a minute (one core): handed out with the e2e level, not last, where one would be the suite's
tail while the other worker sits idle."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def level(item: pytest.Item) -> int:
        parts = item.path.relative_to(Path(__file__).parent).parts
        if parts[0] == "unit" and parts[-1] in LONG_UNIT:
            return RUN_FIRST.index("e2e")
        return RUN_FIRST.index(parts[0]) if parts[0] in RUN_FIRST else len(RUN_FIRST)

    items.sort(key=level)
