"""A cluster that holds trains nothing until news (``outer/hold_pause.py``): the others back, the galaxy
ahead, or the fork due. Why: the strides a cut-off cluster trained again round after round were 81 % of the
elastic chaos soak's waste (goodput 83.7 %)."""

from __future__ import annotations

import threading
import time

import pytest

from open_diloco.outer import hold_pause
from open_diloco.outer.hold_pause import news
from open_diloco.outer.protocols import Membership
from open_diloco.outer.testing import InProcessGalaxy
from tests.support.tiny_outer import run_clusters

PLAIN = dict(on_partial_round="proceed", outer_lr=1.0, outer_momentum=0.0)
ROSTER = frozenset({0, 1, 2, 3})


def view(ages: dict[int, float], lead: int = -1, lead_work: int = 0, **more) -> Membership:
    return Membership(
        ages=ages, lead=lead, lead_work=lead_work, reported={r: (0, None, True) for r in ages}, **more
    )


def test_a_cut_off_cluster_waits_until_a_majority_refreshed_its_records_then_trains_again():
    # cluster 3 cut off at outer step 5: the others' records still read (not expired yet) but none refreshed
    # since the pause began; then the cut heals and their records come new
    stale = view({0: 9.0, 1: 8.5, 2: 9.5, 3: 0.2})
    assert news(stale, paused_for=6.0, own=(50, 5), galaxy_rank=3, need=ROSTER) is None
    healed = view({0: 0.4, 1: 0.3, 2: 9.5, 3: 0.2})
    assert (
        news(healed, paused_for=6.0, own=(50, 5), galaxy_rank=3, need=ROSTER) == "clusters [0, 1] are there"
    )
    # one of three back, not the lowest rank, is no quorum with this one: it waits on (with cluster 0 it
    # would be, by the tie-break)
    one = view({0: 9.0, 1: 0.4, 2: 9.5, 3: 0.2})
    assert news(one, paused_for=6.0, own=(50, 5), galaxy_rank=3, need=ROSTER) is None


def test_the_side_of_an_even_split_without_the_lowest_rank_waits_though_its_pair_refreshes():
    # clusters 2 and 3 average together and hold (two of four, without rank 0): each hears the other, which
    # makes no quorum; only 0 or 1 coming back does
    pair = view({0: 20.0, 1: 20.0, 2: 0.5, 3: 0.1})
    assert news(pair, paused_for=4.0, own=(50, 5), galaxy_rank=3, need=ROSTER) is None
    assert (
        news(view({0: 1.0, 1: 20.0, 2: 0.5, 3: 0.1}), 4.0, (50, 5), 3, ROSTER) == "clusters [0, 2] are there"
    )


def test_its_own_record_is_no_news_and_a_cluster_that_ended_votes_for_nothing():
    alone = view({0: 30.0, 1: 0.0})
    assert news(alone, paused_for=2.0, own=(10, 1), galaxy_rank=1, need=frozenset({0, 1})) is None
    # cluster 2 ended its run: its last record is fresh, but it will average no more
    ended = view({0: 30.0, 1: 30.0, 2: 0.1, 3: 0.0}, departed=frozenset({2}))
    assert news(ended, paused_for=2.0, own=(10, 1), galaxy_rank=3, need=ROSTER) is None
    # ... and once the others ended too, this one is a quorum alone: it goes on (not a fork-after later)
    done = view({0: 30.0, 1: 0.0}, departed=frozenset({0}))
    assert news(done, 2.0, (10, 1), 1, frozenset({0, 1})) == "the others ended their run ([0])"


def test_the_galaxy_ahead_is_news_at_once():
    # the majority committed past this cluster's chain: its next round sits out and takes that state
    ahead = view({0: 30.0, 3: 0.0}, lead=7, lead_work=70)
    assert (
        news(ahead, paused_for=0.5, own=(50, 5), galaxy_rank=3, need=ROSTER)
        == "the galaxy is ahead (outer step 7)"
    )
    # a lighter chain further on is not
    assert news(view({0: 30.0, 3: 0.0}, lead=9, lead_work=40), 0.5, (50, 5), 3, ROSTER) is None


def test_an_elastic_galaxys_first_round_waits_for_as_many_clusters_as_it_needs():
    first = view({11: 0.1, 22: 40.0})
    assert news(first, paused_for=3.0, own=(0, 0), galaxy_rank=11, need=2) is None
    assert news(view({11: 0.1, 22: 40.0, 33: 0.2}), 3.0, (0, 0), 11, need=2) == "clusters [33] are there"


def _holding_alone(fork_after: float = 120.0):
    """Cluster 1 of two, alone after a round together (cluster 0 unheard): it holds every round. Its records:
    its own fresh, cluster 0's from before the cut."""
    galaxy = InProcessGalaxy(2)
    _, _, outer = run_clusters(galaxy, [1.0], {0: [[0.0]], 1: [[0.5]]}, **PLAIN, fork_after=fork_after)[1]
    with galaxy._joining:
        del galaxy.averagers[0]
    galaxy.departed.add(0)
    galaxy.barrier = threading.Barrier(1)
    galaxy.ages = {0: 20.0, 1: 0.0}
    return galaxy, outer


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(hold_pause, "POLL_SECONDS", 0.05)


def test_a_held_cluster_trains_nothing_until_the_other_cluster_is_back():
    galaxy, outer = _holding_alone()
    comes_back = threading.Timer(1.0, lambda: galaxy.ages.update({0: 0.1}))
    comes_back.start()
    began = time.monotonic()
    try:
        record = outer.after_inner_step(2)
    finally:
        comes_back.cancel()
    paused = time.monotonic() - began
    # it waited for cluster 0's record to come new (then within a poll), not a fork-after of 120 s, and the
    # trainer's idle time says so
    assert record["round_outcome"] == "held" and record["compute_utilization"] < 0.5, record
    assert 0.9 <= paused < 5.0, paused


def test_with_no_news_the_pause_ends_when_the_fork_is_due_and_the_next_round_forks():
    galaxy, outer = _holding_alone(fork_after=1.0)
    began = time.monotonic()
    record = outer.after_inner_step(2)
    assert record["round_outcome"] == "held" and record["compute_utilization"] < 0.5, record
    assert 0.9 <= time.monotonic() - began < 5.0
    assert outer.after_inner_step(3)["round_outcome"] == "applied" and outer.ledger.last.fork


def test_without_any_record_read_a_held_cluster_does_not_pause():
    galaxy, outer = _holding_alone()
    galaxy.ages = {}
    began = time.monotonic()
    assert outer.after_inner_step(2)["round_outcome"] == "held"
    assert time.monotonic() - began < 1.0


def test_records_refreshed_within_a_heartbeat_are_clusters_that_are_there_no_pause():
    # four connected clusters, each alone in a round by a matchmaking miss, all hold: the others' records are
    # a few seconds old (a heartbeat is 5 s). Paused until the next refresh they woke apart and missed each
    # other again (107 s in the lan soak); fresh records are news at once, and they retry in step
    connected = view({0: 0.0, 1: 4.2, 2: 6.9, 3: 2.5})
    assert news(connected, 0.0, (50, 5), 0, ROSTER, fresh_within=8.0) == "clusters [1, 2, 3] are there"
    # a cut: the same records a heartbeat and more later, none refreshed since
    cut = view({0: 0.0, 1: 9.2, 2: 11.9, 3: 8.5})
    assert news(cut, 1.0, (50, 5), 0, ROSTER, fresh_within=8.0) is None
