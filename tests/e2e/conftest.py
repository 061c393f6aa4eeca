"""Fixtures of the galaxy tests."""

from __future__ import annotations

import pytest

from open_diloco.local_galaxy import Galaxy


@pytest.fixture
def galaxy(tmp_path):
    """A `hivemind-dht` on 127.0.0.1 and the clusters a test starts; every process checked gone after it.
    (test_averager.py defines its own ``galaxy``: peers of the averager alone.)"""
    g = Galaxy(tmp_path)
    try:
        yield g
    finally:
        g.close()
