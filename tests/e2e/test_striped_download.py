"""A striped state download between real averagers on 127.0.0.1 (``galaxy/striped_download.py``): a joiner
takes one state in parts from every peer that holds it, bitwise, and finishes from the others when one holder
fails. The peers are tests/support/averager_peers.py's; the same path through torchrun clusters, agreed by
their ranks, is tests/e2e/test_striped_join.py."""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.averager_peers import CTX, Galaxy, peer_input

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SERVED = 300_007  # values of the served state's first tensor: 1.2 MB, about 15 parts over 3 holders


@pytest.fixture
def galaxy():
    g = Galaxy()
    try:
        yield g
    finally:
        g.close()


def _download_from_three(
    galaxy, faulty: int | None = None, holders_used: int = 3, fault: str = "drop parts", line: bool = True
) -> tuple:
    """Peers 0-2 serve the same state (peer ``faulty`` with ``fault``); peer 3 downloads it striped over the
    first ``holders_used``, peer 0 the source. The state and the download's log line (``line``)."""
    barrier = CTX.Barrier(4)
    galaxy.start(0, 0, barrier, initial_peers=[], galaxy_size=4, serve=SERVED, **_fault(0, faulty, fault))
    ((_, _, maddrs, _),) = galaxy.wait_for("ready", 1)
    for rank in (1, 2):
        faults = _fault(rank, faulty, fault)
        galaxy.start(rank, 0, barrier, initial_peers=maddrs, galaxy_size=4, serve=SERVED, **faults)
    ready = {m[1]: m[3] for m in galaxy.wait_for("ready", 3)}
    holders = [ready[rank] for rank in range(holders_used)]
    galaxy.start(3, 0, None, initial_peers=maddrs, galaxy_size=4, download=30.0, holders=holders)
    ((_, _, state, seconds),) = galaxy.wait_for("state", 1, timeout=60)
    ((_, _, line),) = galaxy.wait_for("stripe", 1) if line else [(None, None, "")]
    barrier.wait(60)
    assert state is not None, "no state downloaded"
    metadata, tensors = state
    assert metadata == {"outer_step": 7, "lr": 0.5}
    assert torch.equal(tensors[0], peer_input(7, 0, SERVED)) and torch.equal(tensors[1], torch.arange(5))
    by_holder = re.search(r"parts \(([^)]*)\)", line).group(1) if line else ""
    parts = [int(count) for count in re.findall(r": (\d+)", by_holder)]
    return holders, line, parts, seconds


def _fault(rank: int, faulty: int | None, fault: str) -> dict:
    return {"fault": fault} if rank == faulty else {}


def test_a_joiner_takes_one_state_in_parts_from_every_holder(galaxy):
    holders, line, parts, seconds = _download_from_three(galaxy)
    assert "3 holder(s)" in line and len(parts) == 3 and all(count > 0 for count in parts), line
    assert sum(parts) >= 12 and "0 holder(s) dropped" in line, line
    assert seconds < 20, line


def test_a_holder_that_fails_is_dropped_and_the_others_finish(galaxy):
    holders, line, parts, seconds = _download_from_three(galaxy, faulty=2)
    # peer 2 pinned the state (a holder) but answered no part: dropped after two, its parts re-fetched
    assert "3 holder(s)" in line and "1 holder(s) dropped" in line, line
    assert parts[2] == 0 and parts[0] > 0 and parts[1] > 0, line
    assert int(re.search(r"(\d+) part\(s\) re-fetched", line).group(1)) >= 2, line


def test_one_holder_serves_every_part(galaxy):
    # the path every re-sync takes when one cluster holds the wanted state
    holders, line, parts, seconds = _download_from_three(galaxy, holders_used=1)
    # parts sized for 4 a holder from the joiner's own 1 MB buffer: 5 of the 1.2 MB tensor, 1 of the small one
    assert "1 holder(s)" in line and parts == [6], line


def test_a_source_that_pins_nothing_is_read_in_one_stream(galaxy):
    # a source from before striped downloads (no pin RPC) still serves its state whole: the joiner takes it
    # the old way rather than not at all (checked bitwise as every case here)
    _download_from_three(galaxy, faulty=0, holders_used=3, fault="no pin", line=False)
    assert not [m for m in galaxy.messages if m[0] == "stripe"]
