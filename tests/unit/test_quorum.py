"""The quorum (``outer/quorum.py``): which side of a split galaxy commits, the roster the ledger carries, and
a cluster that holds (commits nothing, drops its stride) or, after ``--hv.fork-after``, commits on a fork."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from open_diloco.cluster_id import rank_of
from open_diloco.outer import round as round_module
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.ledger import LedgerEntry, round_entry
from open_diloco.outer.quorum import has_quorum, next_roster, roster_of, smallest_group
from open_diloco.outer.testing import InProcessGalaxy
from tests.support.tiny_outer import linear_model, outer_hv, run_clusters

PLAIN = dict(on_partial_round="proceed", outer_lr=1.0, outer_momentum=0.0)


@pytest.mark.parametrize(
    "members, roster, ended, expected",
    [
        ({0, 1, 2}, {0, 1, 2, 3}, (), True),  # three of four
        ({3}, {0, 1, 2, 3}, (), False),  # the one cut off
        ({0, 1}, {0, 1, 2, 3}, (), True),  # an even split: the side with the lowest rank
        ({2, 3}, {0, 1, 2, 3}, (), False),  # ... and not the other
        ({0}, {0, 1}, (), True),  # two clusters apart: cluster 0 commits
        ({1}, {0, 1}, (), False),  # cluster 1 holds
        ({1}, {0, 1}, (0,), True),  # ... unless cluster 0 said it ended
        ({2, 3}, {0, 1, 2, 3}, (0,), True),  # 2 of the 3 that vote
        ({0, 1, 4}, {0, 1, 2, 3}, (), True),  # a joiner counts for nothing, the two of four still tie-break
        ({1, 4, 5}, {0, 1, 2, 3}, (), False),  # ... nor do joiners make a minority a majority
        ({0}, {0}, (), True),  # a galaxy of one
    ],
)
def test_a_round_commits_with_a_majority_of_the_roster(members, roster, ended, expected):
    assert has_quorum(members, roster, ended) is expected


@pytest.mark.parametrize(
    "roster, ended, alive, expected",
    [
        ({0, 1, 2, 3}, set(), 4, 3),  # four alive: a pair could only hold (the `lan` soak's heal)
        ({0, 1, 2, 3}, set(), 3, 3),  # one cut off: the three close as three
        ({0, 1, 2, 3}, set(), 2, 2),  # a 2 | 2 split once the others' records expired: the pair
        ({0, 1, 2, 3}, {3}, 3, 2),  # one ended: three voters, a pair is a majority
        ({0, 1, 2}, set(), 3, 2),
        ({0, 1}, set(), 2, 2),
        ({0, 1, 2, 3, 4}, set(), 5, 3),
        ({0, 1, 2, 3, 4}, set(), 3, 3),
        ({0, 1, 2, 3, 4}, set(), 2, 2),
        ({0, 1, 2, 3, 4, 5}, set(), 4, 4),
    ],
)
def test_matchmaking_closes_no_group_below_a_majority_while_a_majority_is_alive(
    roster, ended, alive, expected
):
    assert smallest_group(roster, ended, alive) == expected
    # the floor never asks for more than the live clusters, and a group of that size has the quorum
    assert 2 <= expected <= max(2, alive)
    if expected > 2:
        assert has_quorum(sorted(roster - ended)[1 : 1 + expected], roster, ended)


def test_the_roster_drops_who_left_and_takes_back_who_came():
    assert next_roster([[0, 1, 2, 3], [0, 1, 2, 3]], {0, 1, 2}, gone={3}) == (0, 1, 2)
    assert next_roster([[0, 1, 2]], {0, 1, 2, 3}, gone={3}) == (0, 1, 2, 3)  # back: a member again
    assert next_roster([None, [0, 1]], {0, 1}, gone=()) == (0, 1)  # a member of an older version sent none
    assert roster_of(None, 3) == frozenset({0, 1, 2})


@pytest.mark.parametrize("silence, roster", [(30.0, (0, 1, 2, 3)), (600.0, (0, 1, 2))])
def test_a_cut_is_no_leave_the_roster_drops_a_silent_cluster_only_past_fork_after(silence, roster):
    """Cluster 3 is silent: cut off for 30 s, or gone for 10 minutes. Only the second leaves the roster
    (``--hv.fork-after``, 120 s). Why: a side of a 2 | 2 split that dropped the other side as soon as it fell
    silent was left with a roster of two, and a cut of its lowest rank alone then gave that one cluster a
    quorum (half of the roster, with the lowest rank) while the three others held: the galaxy then took the
    cut-off cluster's state (chaos soak `intercontinental`, seed 3)."""
    galaxy = InProcessGalaxy(4, drop={3}, departed={3}, silent={3})
    galaxy.silent_seconds = {3: silence}
    locals_ = {0: [[0.0]], 1: [[0.5]], 2: [[0.25]], 3: [[0.125]]}
    results = run_clusters(galaxy, [1.0], locals_, **PLAIN)
    for rank in (0, 1, 2):
        assert results[rank][2].ledger.last.roster == roster


def test_the_roster_and_the_fork_are_in_the_entry_hash_and_absent_from_older_entries():
    plain = dict(round_no=1, attempt=0, fragment=0, before="a", after="b", peers={}, members={0})
    old = round_entry(**plain)
    assert "roster" not in old.to_wire() and "fork" not in old.to_wire()  # an older entry keeps its hash
    new = round_entry(**plain, roster=(0, 1), fork=True)
    assert LedgerEntry.from_wire(new.to_wire()) == new and new.hash != old.hash


def test_a_cluster_cut_off_from_the_majority_holds_and_drops_its_stride():
    # three clusters, cluster 2 meets nobody (a partition): clusters 0 and 1 commit two rounds; cluster 2
    # commits nothing, and its stride lands on the unchanged θ_outer (dropped: its next Δ stays one stride's)
    galaxy = InProcessGalaxy(3, drop={2})
    locals_ = {0: [[0.0], [0.0]], 1: [[0.5], [0.5]], 2: [[0.25], [0.125]]}
    results = run_clusters(galaxy, [1.0], locals_, **PLAIN)
    for rank in (0, 1):
        _, records, outer = results[rank]
        assert [r["round_outcome"] for r in records] == ["applied", "applied"]
        assert outer.ledger.last.roster == (0, 1, 2) and not outer.ledger.last.fork
    weight, records, outer = results[2]
    assert [r["round_outcome"] for r in records] == ["held", "held"]
    assert [r["outer_step"] for r in records] == [0, 0] and outer.ledger.last is None
    assert weight.item() == 1.0 and outer.state.params.item() == 1.0  # back to θ_outer, untouched


def test_a_held_round_drops_the_progress_of_every_fragment_not_only_its_own():
    """Two fragments of one value each, a sync every step (H = 2, P = 2): cluster 2 is cut off and holds every
    round. After each hold its whole θ_local is θ_outer again: the other fragment's progress, kept before,
    piled up over the strides a held cluster trains again until its Δ was out of bound (chaos soak)."""
    galaxy = InProcessGalaxy(3, drop={2})
    results = {}

    def cluster(rank: int) -> None:
        model = linear_model([1.0, 1.0])
        hv = outer_hv(world_rank=rank, galaxy_size=3, local_steps=2, fragments=2, **PLAIN)
        outer = DiLoCo(model, galaxy.averager(rank, 2), hv, warn=lambda *_: None)
        seen = []
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                model.weight.add_(0.25)  # an inner step's progress, on both fragments
            record = outer.after_inner_step(step)
            seen.append((record["round_outcome"], model.weight.detach().flatten().tolist()))
        results[rank] = seen

    threads = [threading.Thread(target=cluster, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert [outcome for outcome, _ in results[2]] == ["held"] * 4
    assert all(weights == [1.0, 1.0] for _, weights in results[2]), results[2]
    assert [outcome for outcome, _ in results[0]] == ["applied"] * 4


def test_after_fork_after_a_cut_off_cluster_commits_on_a_fork():
    galaxy = InProcessGalaxy(3, drop={2})
    results = run_clusters(galaxy, [1.0], {0: [[0.0]], 1: [[0.5]], 2: [[0.25]]}, **PLAIN, fork_after=0.0)
    _, records, outer = results[2]
    assert records[0]["round_outcome"] == "applied" and outer.state.params.item() == 0.25
    assert outer.ledger.last.fork and outer.ledger.last.ranks == [2]
    assert not results[0][2].ledger.last.fork  # the majority's entry is no fork


def test_a_member_whose_record_cannot_be_read_still_votes():
    # two clusters commit round 1 together: the chain's roster is (0, 1). Then cluster 1 reads no record of
    # cluster 0 at all (a side of a split whose DHT cannot reach it yet), which says nothing of cluster 0
    # having ended: cluster 1 alone is no majority, and holds (the soak of 2026-12-02 evening: a cluster back
    # from a split read "1 of 4 alive" and committed a round alone that the majority then took)
    galaxy = InProcessGalaxy(2)
    results = run_clusters(galaxy, [1.0], {0: [[0.0]], 1: [[0.5]]}, **PLAIN)
    _, records, outer = results[1]
    assert records[0]["round_outcome"] == "applied" and outer.ledger.last.roster == (0, 1)
    with galaxy._joining:
        del galaxy.averagers[0]  # no record of cluster 0 ...
    galaxy.departed.add(0)  # ... so the membership calls it gone, without a record saying it ended
    galaxy.barrier = threading.Barrier(1)
    assert outer.after_inner_step(2)["round_outcome"] == "held"


def _holding_alone(**hv):
    """The scene above: cluster 1 of two, alone after a round together, holds every round; its warnings."""
    galaxy = InProcessGalaxy(2)
    _, _, outer = run_clusters(galaxy, [1.0], {0: [[0.0]], 1: [[0.5]]}, **PLAIN, **hv)[1]
    said = []
    outer.rounds.warn = said.append
    with galaxy._joining:
        del galaxy.averagers[0]
    galaxy.departed.add(0)
    galaxy.barrier = threading.Barrier(1)
    return outer, said


def test_a_cluster_that_holds_round_after_round_says_so_once_and_again_when_the_hold_ends():
    # one warning for the hold, not one a round (a cut-off cluster holds at every stride: in the soak, half
    # its log), and one line when the hold ends (here on a fork, after --hv.fork-after)
    outer, said = _holding_alone(fork_after=1.0)
    assert [outer.after_inner_step(step)["round_outcome"] for step in (2, 3, 4, 5)] == ["held"] * 4
    holds = [line for line in said if "no majority of the roster" in line]
    assert len(holds) == 1 and "held 1 round(s)" in holds[0], said
    time.sleep(1.1)  # past --hv.fork-after
    assert outer.after_inner_step(6)["round_outcome"] == "applied" and outer.ledger.last.fork
    assert any("applied after holding 4 round(s)" in line for line in said), said


def test_a_long_hold_says_so_again_after_the_reminder_interval(monkeypatch):
    monkeypatch.setattr(round_module, "HOLD_REMINDER_SECONDS", 0.0)
    outer, said = _holding_alone()
    assert [outer.after_inner_step(step)["round_outcome"] for step in (2, 3)] == ["held"] * 2
    assert len(said) == 2 and "held 1 round(s)" in said[0] and "held 2 round(s)" in said[1], said


def test_before_any_roster_a_cluster_never_heard_of_votes_in_no_quorum():
    # a galaxy of two whose cluster 0 never started: cluster 1 trains on (the roster of genesis, every rank,
    # names clusters that may never come)
    galaxy = InProcessGalaxy(1)
    galaxy.departed.add(0)
    hv = outer_hv(world_rank=1, galaxy_size=2, **PLAIN)
    outer = DiLoCo(linear_model([1.0]), galaxy.averager(1, 1), hv, warn=lambda *_: None)
    assert outer.after_inner_step(1)["round_outcome"] == "applied"
    # ... and on: the first entry's roster leaves it out, so the next rounds do not hold for it
    assert outer.ledger.last.roster == (1,)
    assert outer.after_inner_step(2)["round_outcome"] == "applied"


def test_an_elastic_galaxys_first_round_holds_until_it_has_its_clusters_then_forks_after_fork_after():
    # a cluster without a rank whose galaxy's first round needs two: alone, it commits nothing (and says why
    # once), until --hv.fork-after, when it commits on a fork whose roster is itself: never a hold for good
    rank = rank_of("solo")
    hv = outer_hv(galaxy_size=2, fork_after=1.0, **PLAIN).model_copy(
        update={"cluster_id": "solo", "world_rank": rank}
    )
    said = []
    outer = DiLoCo(linear_model([1.0]), InProcessGalaxy(1).averager(rank, 1), hv, warn=said.append)
    assert [outer.after_inner_step(step)["round_outcome"] for step in (1, 2, 3)] == ["held"] * 3
    assert outer.ledger.last is None and len(said) == 1 and "first round needs 2 clusters" in said[0], said
    time.sleep(1.1)
    assert outer.after_inner_step(4)["round_outcome"] == "applied"
    assert outer.ledger.last.fork and outer.ledger.last.roster == (rank,)
    assert any("the first round's 2 clusters for --hv.fork-after=1s" in line for line in said), said


def test_the_steps_a_held_round_dropped_are_behind_no_later_delta():
    """H = 2, P = 2: cluster 1 of two, alone after a round together, holds three rounds of fragment 1 (its
    outer step stays, so does the fragment), then forks. Fragment 0's next Δ holds the two strides trained
    since the last hold dropped every fragment's progress, and its entry says 2 inner steps: counted on from
    its last sync, it said 5 (a cluster that held a minute in the `intercontinental` soak committed one
    stride as 108 steps: ledger work and goodput counted progress thrown away)."""
    galaxy = InProcessGalaxy(2)
    setting = dict(local_steps=2, fragments=2, fork_after=0.5, **PLAIN)
    _, _, outer = run_clusters(galaxy, [1.0], {0: [[0.0]], 1: [[0.5]]}, **setting)[1]
    with galaxy._joining:
        del galaxy.averagers[0]
    galaxy.departed.add(0)
    galaxy.barrier = threading.Barrier(1)
    assert [outer.after_inner_step(step)["round_outcome"] for step in (2, 3, 4)] == ["held"] * 3
    time.sleep(0.6)  # past --hv.fork-after
    assert outer.after_inner_step(5)["round_outcome"] == "applied" and outer.ledger.last.fork
    assert outer.after_inner_step(6)["round_outcome"] == "applied"
    forked, after = outer.ledger.entries[-2:]
    assert [(m.rank, m.inner_steps) for m in forked.members] == [(1, 1)]  # its stride since the last hold
    assert [(m.rank, m.inner_steps) for m in after.members] == [(1, 2)]
