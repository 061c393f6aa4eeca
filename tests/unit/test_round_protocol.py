"""The round protocol with clusters of two ranks (threads sharing a real gather,
``tests/support/thread_cluster``): the commit rule (a cluster applies a round only when every shard's average
came whole from the same clusters), a round taken from the cluster that committed it, state from one source,
the round in the matchmaking key."""

from __future__ import annotations

import types

import pytest
import torch

from open_diloco.config import HvConfig
from open_diloco.galaxy.round_wait import round_key_bits
from open_diloco.outer.adoption import StateAdoption
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.guard import NormHistory
from open_diloco.outer.protocols import Membership, RoundReport
from open_diloco.outer.round import Contribution, Phase, Round, RoundId, RoundView
from open_diloco.outer.testing import InProcessAverager, InProcessGalaxy
from tests.support.thread_cluster import ThreadCluster


def _report(group: list[int], complete: bool = True, stale: list[int] | None = None, own_hash: str = "h"):
    peers = {rank: {"galaxy_rank": rank, "round_id": 0, "param_hash": own_hash} for rank in group}
    return RoundReport(group_size=len(group), complete=complete, peers=peers, stale=stale or [])


def _views(reports: list[RoundReport]) -> list[RoundView]:
    return ThreadCluster(len(reports)).run(
        lambda rank, comm: RoundView.agree(comm, reports[rank], False, "h", galaxy_rank=0)
    )


def test_a_round_is_committable_only_when_every_shard_got_it_whole_from_the_same_clusters():
    whole = _views([_report([0, 1]), _report([0, 1])])
    assert all(view.committable and view.group == {0, 1} for view in whole)
    short = _views([_report([0, 1]), _report([0, 1], complete=False)])  # one shard's last average never came
    assert all(not view.whole and not view.committable for view in short)
    split = _views([_report([0, 1, 2]), _report([0, 1])])  # three clusters at the matchmaking edge
    assert all(view.whole and not view.same_group and not view.committable for view in split)
    assert all(view.shard_groups == ("0,1,2", "0,1") and not view.overtaken_shards for view in split)


def test_a_cluster_left_out_by_one_shard_is_left_out_on_every_rank():
    views = _views([_report([0, 1]), _report([0, 1], stale=[0])])
    assert all(view.left_out and view.stale == [0] and not view.in_sync for view in views)


def test_the_round_and_the_attempt_are_in_the_matchmaking_key():
    keys = {round_key_bits(round_id, attempt) for round_id in range(40) for attempt in range(4)}
    assert len(keys) == 160 and all(set(key) <= {"0", "1"} for key in keys)


def test_zero_claims_never_make_the_bound_zero():
    # after a re-sync a cluster may send a fragment with no inner step since: ‖Δ‖ = 0. Counted, the median
    # (and the bound) became 0 and every healthy Δ after it was "out of bound" (2 clusters stopped,
    # 2026-11-27)
    history = NormHistory(factor=10.0)
    history.record([1.0, 2.0])
    for _ in range(5):
        history.record([0.0, 0.0, 3.0])
    assert history.bound() == 30.0  # the median of the rounds' medians of the positive claims (3.0), times 10
    history.record([0.0])
    assert history.bound() > 0


class ShardPeer(InProcessAverager):
    """One rank's averager in a cluster of two ranks: its round reports what the test says; the membership
    shows the clusters ``served`` names (galaxy rank → (metadata, tensors)) and downloads answer with them."""

    def __init__(
        self,
        numel: int,
        reports: list[RoundReport],
        served: dict,
        membership_after: int = 0,
        shown_from_read: int = 0,
    ):
        super().__init__(InProcessGalaxy(1), 0, numel)
        self.reports, self.served, self.membership_after = reports, served, membership_after
        self.shown_from_read, self.reads = shown_from_read, 0
        self.sources_asked: list[str] = []
        self.peers_say: dict[int, dict] = {}
        """Galaxy rank → what that peer's round metadata says besides ours (e.g. its ``gone``)."""

    def start_round(self, round_id, fingerprint, attempt=0, plan=None):
        self.calls += 1
        report = self.reports[min(self.calls, len(self.reports)) - 1]
        own = {"galaxy_rank": 0, "round_id": round_id, "attempt": attempt, **fingerprint}
        said = self.peers_say.get
        report.peers = {rank: {**own, **said(rank, {}), "galaxy_rank": rank} for rank in report.peers}
        return types.SimpleNamespace(wait=lambda: report)

    def membership(self):
        self.reads += 1
        if self.calls < self.membership_after or self.reads < self.shown_from_read:
            return Membership()
        steps = {rank: int(meta["outer_step"]) for rank, (meta, _) in self.served.items()}
        sources = {rank: str(rank) for rank in self.served}
        return Membership(lead=max(steps.values(), default=-1), steps=steps, sources=sources)

    def download_state(self, timeout, source=None, holders=None):
        self.sources_asked.append(source)
        meta, tensors = self.served[int(source)]
        return dict(meta), [tensor.clone() for tensor in tensors]


def _served(values: list[float], step: int, group: list[int]):
    """What a cluster's shard serves after committing round ``step`` with ``group``."""
    donor = DiLoCo(_model(values), InProcessGalaxy(1).averager(1, len(values)), _hv(), warn=lambda *_: None)
    donor.state.outer_step, donor.state.committed_group = step, group
    return donor.committed.served()


def _model(values: list[float]) -> torch.nn.Module:
    model = torch.nn.Linear(len(values), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values]))
    return model


def _hv(**overrides) -> HvConfig:
    settings = dict(
        local_steps=1, outer_lr=1.0, outer_momentum=0.0, galaxy_size=2, world_rank=0, join_timeout=2.0
    )
    return HvConfig(**{**settings, **overrides})


def test_a_shard_whose_average_came_short_makes_its_cluster_take_the_committed_round_on_every_shard():
    # Cluster 0, two ranks. Round 1: rank 0's shard got its average whole from {0, 1}; rank 1's last average
    # never came (a lost stream). Cluster 1 got everything and committed. Before: rank 1 applied what had
    # arrived, rank 0 the whole average: a model no cluster held, repaired a round later. Now neither rank
    # applies anything of its own; both take round 1 from cluster 1 (one source), and since cluster 0's Δ is
    # in it, it is a commit.
    served = [
        {1: _served([0.25, 0.5], step=1, group=[0, 1])},
        {1: _served([0.75, 1.0], step=1, group=[0, 1])},
    ]
    peers = [
        ShardPeer(2, [_report([0, 1])], served[0], membership_after=2),
        ShardPeer(2, [_report([0, 1], complete=False), _report([0])], served[1], membership_after=2),
    ]
    warnings: list[str] = []

    def rank(local: int, comm):
        model = _model([1.0, 2.0] if local == 0 else [3.0, 4.0])
        outer = DiLoCo(model, peers[local], _hv(), cluster=comm, warn=warnings.append)
        with torch.no_grad():
            model.weight.add_(1.0)  # an inner step's progress
        return outer.after_inner_step(1), outer.state.params.clone()

    (record0, params0), (record1, params1) = ThreadCluster(2).run(rank)
    for record in (record0, record1):
        assert record["round_outcome"] == "adopted" and record["committed"] and not record["resynced"], (
            warnings
        )
        assert record["outer_step"] == 1 and record["state_source"] == 1 and record["attempt"] == 1
    torch.testing.assert_close(params0, torch.tensor([0.25, 0.5]))  # cluster 1's bytes, not a partial average
    torch.testing.assert_close(params1, torch.tensor([0.75, 1.0]))
    assert peers[0].sources_asked == peers[1].sources_asked == ["1"]


def test_a_commit_seen_only_when_the_retry_starts_is_taken_as_a_commit_not_a_resync():
    # The committer's record showed up between the check after the partial round (2nd membership read: not
    # yet) and the retry's start (3rd read: cluster 1 is at round 1). Before, the retry sat the round out and
    # re-synced (CI, 2026-11-27); our Δ is in cluster 1's round, so taking it is our commit.
    served = {1: _served([0.5, 0.25], step=1, group=[0, 1])}
    peer = ShardPeer(2, [_report([0, 1], complete=False)], served, shown_from_read=3)
    warnings: list[str] = []
    model = _model([1.0, 2.0])
    outer = DiLoCo(model, peer, _hv(), warn=warnings.append)
    with torch.no_grad():
        model.weight.add_(1.0)
    record = outer.after_inner_step(1)
    assert record["round_outcome"] == "adopted" and record["committed"] and not record["resynced"], warnings
    assert record["state_source"] == 1 and peer.calls == 1  # the retry never went on the wire
    torch.testing.assert_close(outer.state.params, torch.tensor([0.5, 0.25]))


def test_every_rank_downloads_its_shard_from_rank_0s_choice_and_agrees_on_the_step():
    # rank 1's records say cluster 2 is further ahead; rank 0 picks cluster 1: both ranks take cluster 1's
    # shards (a θ_outer that cluster holds whole), never one shard of each
    ahead = {1: ({"outer_step": 5}, [torch.ones(2)]), 2: ({"outer_step": 5}, [torch.zeros(2)])}
    further = {1: ({"outer_step": 5}, [torch.ones(2)]), 2: ({"outer_step": 6}, [torch.zeros(2)])}
    peers = [ShardPeer(2, [], ahead), ShardPeer(2, [], further)]
    got = ThreadCluster(2).run(lambda rank, comm: StateAdoption(peers[rank], comm, 0, print).download(5, 2.0))
    assert [d.source for d in got] == [1, 1] and [d.step for d in got] == [5, 5]
    # and shards at different steps are never taken: cluster 1 serves step 5 to rank 0 and step 6 to rank 1
    torn = [
        ShardPeer(2, [], {1: ({"outer_step": 5}, [torch.ones(2)])}),
        ShardPeer(2, [], {1: ({"outer_step": 6}, [torch.ones(2)])}),
    ]
    got = ThreadCluster(2).run(lambda rank, comm: StateAdoption(torn[rank], comm, 0, print).download(5, 1.0))
    assert got == [None, None]


def test_a_download_whose_bytes_do_not_match_the_served_hash_is_never_taken():
    # a state read while its server was applying a round (or cut short, or garbled) must not become θ_outer
    meta, tensors = _served([0.5, 0.5], step=3, group=[1])
    torn = [ShardPeer(2, [], {1: (meta, [tensors[0] + 1.0])}), ShardPeer(2, [], {1: (meta, tensors)})]
    got = ThreadCluster(2).run(
        lambda rank, comm: StateAdoption(torn[rank], comm, 0, lambda *_: None).download(3, 1.0)
    )
    assert got == [None, None]  # one rank's shard is bad: neither rank takes anything


def test_a_cluster_starting_a_round_joins_the_attempt_the_galaxy_is_in():
    # three clusters at the matchmaking edge: clusters 1 and 2 retried round 1 (attempt 1) while this one's
    # shard still looked for a group in attempt 0. Its next start joins attempt 1, not an attempt nobody is
    # in.
    class InAttempt(ShardPeer):
        def membership(self):
            return Membership(attempts={1: (1, 1), 2: (1, 1), 0: (1, 0)})

    peer = InAttempt(1, [_report([0, 1, 2])], {})
    outer = DiLoCo(_model([1.0]), peer, _hv(galaxy_size=3), warn=lambda *_: None)
    started: list[int] = []
    start = peer.start_round
    peer.start_round = lambda round_id, fingerprint, attempt=0, plan=None: (
        started.append(attempt) or start(round_id, fingerprint, attempt)
    )
    record = outer.after_inner_step(1)
    assert started == [1] and record["attempt"] == 1 and record["round_outcome"] == "applied"


def test_a_peer_looking_for_a_group_moves_on_only_when_every_other_live_cluster_has():
    from open_diloco.galaxy.round_wait import everyone_moved_on

    view = Membership(attempts={0: (4, 0), 1: (4, 1), 2: (4, 2)})
    assert everyone_moved_on(view, galaxy_rank=0, round_no=4, attempt=0)
    assert not everyone_moved_on(view, galaxy_rank=1, round_no=4, attempt=1)  # cluster 0 may still come to 1
    assert not everyone_moved_on(
        Membership(attempts={0: (4, 0), 1: (3, 2)}), 0, 4, 0
    )  # 1 is behind: it comes
    assert everyone_moved_on(Membership(attempts={0: (4, 0), 1: (5, 0)}), 0, 4, 0)  # 1 is past the round
    assert not everyone_moved_on(Membership(), 0, 4, 0)  # nothing known: keep looking


def test_the_final_round_is_compared_with_every_cluster_that_ends_at_the_same_step():
    # the per-round check compares where rounds start: a last round that came out differently would go unseen
    class Ended(ShardPeer):
        def membership(self):
            return Membership(
                reported={
                    0: (7, "mine", False),
                    1: (7, "mine", False),
                    2: (7, "other", True),
                    3: (5, "old", False),
                }
            )

    warnings: list[str] = []
    outer = DiLoCo(_model([1.0]), Ended(1, [], {}), _hv(galaxy_size=4), warn=warnings.append)
    outer.state.outer_step = 7
    assert outer.catch_up.verify_final("mine", seconds=1.0) == [1]
    assert len(warnings) == 1 and "unlike that of cluster(s) [2]" in warnings[0]


def test_a_final_round_nobody_confirms_names_the_clusters_that_went_silent():
    # a partition that outlasts the run: the cut-off cluster trained on alone and ends with nobody at its step
    class CutOff(ShardPeer):
        def membership(self):
            return Membership(reported={1: (5, "older", True), 2: (7, None, False)}, silent=frozenset({1}))

    warnings: list[str] = []
    outer = DiLoCo(_model([1.0]), CutOff(1, [], {}), _hv(galaxy_size=3), warn=warnings.append)
    outer.state.outer_step = 7
    assert outer.catch_up.verify_final("mine", seconds=0.0) is None
    assert (
        len(warnings) == 1
        and "no other cluster confirming" in warnings[0]
        and "[1] went silent" in warnings[0]
    )
    warnings.clear()  # confirmed by one cluster: the silent one is not this run's concern
    outer.averager.membership = lambda: Membership(reported={2: (7, "mine", False)}, silent=frozenset({1}))
    assert outer.catch_up.verify_final("mine", seconds=0.0) == [2] and warnings == []


def test_out_of_attempts_alone_a_cluster_takes_the_round_another_committed_rather_than_its_own():
    # the soak's split last round: a late cluster's attempts all came out alone while the other two committed
    # the round, their records not yet read; it applied its own Δ alone and ended the run on another θ_outer.
    # Now it waits for a committer's record (a heartbeat or so) and takes that round.
    served = {1: _served([0.25], step=1, group=[1, 2])}
    peer = ShardPeer(
        1, [_report([0])], served, membership_after=4
    )  # the record shows up after the 3 attempts
    warnings: list[str] = []
    outer = DiLoCo(
        _model([1.0]),
        peer,
        _hv(galaxy_size=3, heartbeat_interval=1.0, member_expiry=3.0),
        warn=warnings.append,
    )
    started = {}
    membership = peer.membership

    def later_membership():
        started.setdefault("reads", 0)
        started["reads"] += 1
        if peer.calls >= 3 and started["reads"] > 6:  # a few reads after the last attempt
            peer.membership_after = 0
        return membership()

    peer.membership = later_membership
    record = outer.after_inner_step(1)
    assert peer.calls == 3 and record["round_outcome"] == "resynced" and record["state_source"] == 1, warnings
    torch.testing.assert_close(outer.state.params, torch.tensor([0.25]))  # the galaxy's round, not its own Δ
    assert not any("applies its own pseudo-gradient alone" in line for line in warnings)


def _started(peer: ShardPeer, **overrides):
    """A round started by a one-rank cluster after one inner step's progress (``outer/round.py``)."""
    model = _model([1.0, 2.0])
    outer = DiLoCo(model, peer, _hv(**overrides), warn=lambda *_: None)
    with torch.no_grad():
        model.weight.add_(1.0)
    outer.state.begin_round(0, keep_local=False)
    return outer, Round.start(outer.rounds, Contribution())


def test_a_round_goes_through_its_phases_and_a_retried_attempt_ends_retried():
    outer, whole = _started(ShardPeer(2, [_report([0, 1])], {}))
    assert whole.id == RoundId(1, 0) and whole.phase is Phase.STARTED
    result = whole.finish()
    assert result.outcome == "applied" and result.ledger is not None and result.ledger.round == 1
    assert whole.phase is Phase.COMMITTED
    assert whole.history == [Phase.STARTED, Phase.AVERAGED, Phase.DECIDED]
    with pytest.raises(RuntimeError, match="no move from committed to taken"):
        whole._enter(Phase.TAKEN)  # an ended round never changes its end

    # a partial round (1 of 2 live clusters) under --hv.on-partial-round retry: attempt 0 ends retried and
    # attempt 1, with the same Δ, commits the whole group's average
    peer = ShardPeer(2, [_report([0]), _report([0, 1])], {})
    outer, partial = _started(peer)
    result = partial.finish()
    assert partial.phase is Phase.RETRIED and peer.calls == 2
    assert result.outcome == "applied" and result.attempt == 1 and result.ledger.attempt == 1


def test_the_members_of_a_round_agree_on_who_is_gone_so_all_commit_or_all_retry():
    # the `home` soak's heal (2026-12-02): cluster 2, back from a cut, was late; cluster 1 (a read behind)
    # still called it gone, found its group {0, 1} whole and committed, while cluster 0 counted it alive,
    # retried a "partial" round, then took cluster 1's round and came late to the next one. The round's
    # metadata carries each member's `gone`: both now read one view of who is coming
    peer = ShardPeer(2, [_report([0, 1]), _report([0, 1])], {})
    peer.peers_say = {1: {"gone": [2]}}
    outer, round_ = _started(peer, galaxy_size=3)
    assert round_.alive == 3 and round_.gone == frozenset()  # to this cluster alone, cluster 2 is coming
    result = round_.finish()
    assert peer.calls == 1 and result.outcome == "applied" and result.attempt == 0
    assert result.ledger.ranks == [0, 1]

    # nobody in the group calls cluster 2 gone: the round is partial to every member, and retried
    peer = ShardPeer(2, [_report([0, 1]), _report([0, 1, 2])], {})
    outer, round_ = _started(peer, galaxy_size=3)
    result = round_.finish()
    assert peer.calls == 2 and result.outcome == "applied" and result.attempt == 1


def test_a_round_behind_the_galaxy_sits_out_and_ends_taken():
    served = {1: _served([0.5, 0.25], step=3, group=[1])}
    outer, behind = _started(ShardPeer(2, [], served))
    assert behind.sits_out and behind.phase is Phase.SITTING_OUT and behind.lead == 3
    result = behind.sit_out()
    assert behind.phase is Phase.TAKEN and result.outcome == "resynced" and result.state_source == 1
    assert outer.outer_step == 3
    torch.testing.assert_close(outer.state.params, torch.tensor([0.5, 0.25]))
