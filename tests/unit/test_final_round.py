"""The end of a split galaxy's run (``outer/final_round.py``, ``CatchUp.settle_final``): the larger side's
θ_outer wins, ties to the side of the lowest galaxy rank, and a cluster of the smaller side takes it (from one
source, before its final checkpoint); one that went silent is waited for up to ``--hv.final-wait``."""

from __future__ import annotations

import time

import torch

from open_diloco.outer.adoption import choose_source
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.final_round import final_step, final_verdict
from open_diloco.outer.protocols import Membership
from open_diloco.outer.round_result import RoundResult
from tests.unit.test_round_protocol import ShardPeer, _hv, _model, _served


def _ended(reported: dict, sources=(), silent=(), works=None) -> Membership:
    return Membership(
        reported=reported,
        works=works or {},
        steps={rank: reported[rank][0] for rank in sources},
        sources={rank: str(rank) for rank in sources},
        silent=frozenset(silent),
    )


def test_the_larger_side_wins_and_a_tie_goes_to_the_side_of_the_lowest_rank():
    view = _ended({0: (7, "a", False), 2: (7, "a", False), 3: (5, "old", True)}, sources=[0, 2])
    verdict = final_verdict(view, 1, 7, "b")
    assert verdict.winner_hash == "a" and verdict.winners == {0, 2} and verdict.losers == {1}
    assert verdict.source_for(1, view) == 0  # cluster 3 is not at step 7: no say
    assert final_verdict(view, 0, 7, "a").source_for(0, view) is None  # a winner takes nothing
    tie = _ended({0: (7, "a", False)}, sources=[0])
    assert final_verdict(tie, 1, 7, "b").source_for(1, tie) == 0
    assert final_verdict(_ended({1: (7, "b", False)}, sources=[1]), 0, 7, "a").winners == {0}
    gone = _ended({0: (7, "a", False), 2: (7, "a", False)})  # the winners no longer serve
    assert final_verdict(gone, 1, 7, "b").source_for(1, gone) is None


class SplitGalaxy(ShardPeer):
    """Clusters 0 and 2 end at outer step 7 on one θ_outer (``"theirs"``) and serve it; after
    ``silent_reads`` membership reads that show them silent."""

    def __init__(self, silent_reads: int = 0):
        served = _served([0.25], step=7, group=[0, 2])
        super().__init__(1, [], {0: served, 2: served})
        self.silent_reads = silent_reads

    def membership(self):
        self.reads += 1
        if self.reads <= self.silent_reads:
            return _ended({0: (5, "theirs", False), 2: (5, "theirs", False)}, silent=[0, 2])
        return _ended({0: (7, "theirs", False), 2: (7, "theirs", False)}, sources=[0, 2])


def _last_round(outer: DiLoCo) -> RoundResult:
    outer.state.outer_step = 7
    return RoundResult("applied", 7, 0, "mine", 1.0, galaxy_alive=1)


def test_a_cluster_of_the_smaller_side_ends_on_the_larger_sides_theta():
    warnings: list[str] = []
    model = _model([1.0])
    outer = DiLoCo(model, SplitGalaxy(), _hv(galaxy_size=3, world_rank=1), warn=warnings.append)
    settled = outer.catch_up.settle_final(_last_round(outer))
    assert settled is not None and settled.outcome == "resynced" and settled.state_source == 0
    assert settled.outer_step == 7 and settled.param_hash != "mine"
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.25]]))  # in the model, for the export
    assert outer.averager.sources_asked == ["0"]  # one source
    assert len(warnings) == 1 and "larger side wins (2 cluster(s) [0, 2] against [1])" in warnings[0]


def test_a_silent_side_is_waited_for_up_to_final_wait():
    model = _model([1.0])
    outer = DiLoCo(
        model, SplitGalaxy(silent_reads=2), _hv(galaxy_size=3, world_rank=1, final_wait=10.0), warn=print
    )
    started = time.monotonic()
    settled = outer.catch_up.settle_final(_last_round(outer))
    assert settled is not None and settled.state_source == 0 and 1.5 < time.monotonic() - started < 6
    # without the wait, the silent side has no say: the cluster keeps its own θ_outer
    model = _model([1.0])
    no_wait = _hv(galaxy_size=3, world_rank=1, final_wait=0.0)
    outer = DiLoCo(model, SplitGalaxy(silent_reads=99), no_wait, warn=print)
    assert outer.catch_up.settle_final(_last_round(outer)) is None
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[1.0]]))


def test_a_read_that_shows_no_other_cluster_is_read_again():
    """A DHT read that met a cut-off node comes back empty: that is not a galaxy gone (records outlive their
    clusters by an hour), and ending at once would leave the cluster on its own θ_outer."""

    class Unread(SplitGalaxy):
        def membership(self):
            self.empty = getattr(self, "empty", 0) + 1
            return Membership() if self.empty <= 2 else super().membership()

    outer = DiLoCo(_model([1.0]), Unread(), _hv(galaxy_size=3, world_rank=1), warn=print)
    settled = outer.catch_up.settle_final(_last_round(outer))
    assert settled is not None and settled.state_source == 0


def test_only_a_cluster_silent_for_less_than_final_wait_is_waited_for():
    """A cut across the run's end is back within minutes, a crash never is: the default wait (120 s) is for
    the recent silence only, so a cluster that crashed long before the end costs the others nothing."""
    assert _hv().final_wait == 120.0

    class LongSilent(SplitGalaxy):
        def membership(self):
            view = super().membership()
            return Membership(**{**view.__dict__, "silent": frozenset({3}), "silent_seconds": {3: 400.0}})

    outer = DiLoCo(_model([1.0]), LongSilent(), _hv(galaxy_size=4, world_rank=1), warn=print)
    started = time.monotonic()
    settled = outer.catch_up.settle_final(_last_round(outer))
    assert settled is not None and settled.state_source == 0 and time.monotonic() - started < 1.0


def test_a_finished_cluster_serves_only_its_last_round_never_as_the_galaxys_lead():
    # a side cut off by a partition finishes first, alone; the larger side, behind it, must not take its final
    # state as the galaxy's (seen in a targeted soak: the larger side ended on the smaller side's θ_outer)
    view = _ended({0: (12, "alone", False), 2: (3, "h", True)}, sources=[0, 2])
    assert choose_source(view, 1, 3, exact=3) == (2, 3)
    assert choose_source(view, 1, 4, exact=4) is None  # only the finished one is that far: nobody
    assert choose_source(view, 1, 12, exact=12) == (0, 12)  # its own last round: it serves that


def test_a_cluster_back_to_a_finished_galaxy_takes_its_final_state():
    """Cut off across the run's end (chaos soak `lan` seed 3): the others finished at outer step 230 while
    this cluster held round 228. Nobody trains on, so their final state, the heaviest chain, is the one to
    take (the trainer then jumps to the run's end and ends in sync) instead of a 60 s wait for round 228 that
    no cluster will serve, two rounds alone and a split ending."""
    works = {0: 900, 1: 700, 3: 900}
    done = _ended({0: (230, "final", False), 3: (230, "final", False)}, sources=[0, 3], works=works)
    assert choose_source(done, 1, 228, exact=228, min_work=700) == (0, 230)
    # a lighter finished chain is still never taken
    assert choose_source(done, 1, 228, exact=228, min_work=950) is None
    # while any other cluster trains on, a finished one serves only its own last round (as before)
    ended = {0: (230, "final", False), 2: (227, "h", True), 3: (230, "final", False)}
    training = _ended(ended, sources=[0, 2, 3], works=works)
    assert choose_source(training, 1, 228, exact=228, min_work=700) is None


def test_a_cluster_that_ends_behind_the_galaxys_last_rounds_ends_on_their_theta():
    # cluster 1 reached the run's last step at outer step 5 (its inner steps ran ahead of the rounds while it
    # held); clusters 0 and 2 went on to 7 and finished there: it ends on their θ_outer, not on its own
    view = _ended({0: (7, "theirs", False), 2: (7, "theirs", False), 3: (9, "live", True)})
    assert final_step(view, 1, 5) == (0, 7)  # the furthest a finished cluster reached (3 still trains)
    assert final_step(view, 1, 8) == (0, 8)
    verdict = final_verdict(view, 1, 7, None)
    assert verdict.winners == {0, 2} and 1 not in verdict.losers
    warnings: list[str] = []
    model = _model([1.0])
    outer = DiLoCo(model, SplitGalaxy(), _hv(galaxy_size=3, world_rank=1), warn=warnings.append)
    outer.state.outer_step = 5
    settled = outer.catch_up.settle_final(RoundResult("applied", 5, 0, "mine", 1.0, galaxy_alive=3))
    assert settled is not None and settled.outer_step == 7 and settled.state_source == 0
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.25]]))
    assert "the galaxy went on to outer step 7 after this cluster's last round" in warnings[0]


def test_the_chain_with_more_committed_work_wins_at_the_end_whatever_its_round_or_its_size():
    """One rule mid-run and at the end (``outer/quorum.py``): a lone fork that finished further in rounds but
    with less committed work does not win; at one outer step the heavier chain wins over the larger group."""
    view = _ended(
        {0: (30, "fork", False), 2: (20, "kept", False), 3: (20, "kept", False)},
        sources=[0, 2, 3],
        works={0: 150, 2: 240, 3: 240},
    )
    assert final_step(view, 1, 19, own_work=225) == (240, 20)
    verdict = final_verdict(view, 1, 20, None, own_work=225)
    assert verdict.winner_hash == "kept" and verdict.source_for(1, view) == 2
    heavier = _ended({0: (7, "a", False), 2: (7, "a", False)}, sources=[0, 2], works={0: 70, 2: 70})
    verdict = final_verdict(heavier, 1, 7, "b", own_work=90)
    assert verdict.winners == {1} and verdict.losers == {0, 2}
    # the lighter fork is never a source, not even at its own last round
    assert choose_source(view, 1, 20, exact=20, min_work=225) == (2, 20)
    assert choose_source(view, 1, 30, exact=30, min_work=225) is None
