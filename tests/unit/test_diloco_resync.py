"""DiLoCo for a cluster behind or apart from the galaxy: it sends nothing from an old θ_outer, is left out of
a round it started elsewhere, and takes the galaxy's state (a re-sync, or the round it missed). In-process
averager (no hivemind)."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from open_diloco.outer.digests import combine_hashes
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.policy import out_of_cohort
from open_diloco.outer.protocols import Membership, RoundReport
from open_diloco.outer.testing import InProcessAverager, InProcessGalaxy
from tests.support.tiny_outer import linear_model, outer_hv


def test_a_cluster_behind_the_galaxy_sends_nothing_and_adopts_its_state():
    # the membership records show a live cluster at outer step 3 while this one is at 0 (say, a late joiner
    # whose download is already old): its Δ comes from an older θ_outer and must never enter the average
    galaxy = InProcessGalaxy(1, serve_state=True)
    hv = dict(galaxy_size=2, on_partial_round="proceed", outer_lr=1.0, outer_momentum=0.0, join_timeout=5.0)
    ahead_model = linear_model([1.0])
    ahead = DiLoCo(ahead_model, galaxy.averager(0, 1), outer_hv(world_rank=0, **hv), warn=lambda *_: None)
    for local in (0.5, 0.25, 0.125):
        with torch.no_grad():
            ahead_model.weight.fill_(local)
        ahead.after_inner_step(1)
    galaxy.lead = 3
    warnings: list[str] = []
    model = linear_model([1.0])
    behind = DiLoCo(model, galaxy.averager(1, 1), outer_hv(world_rank=1, **hv), warn=warnings.append)
    with torch.no_grad():
        model.weight.fill_(7.0)
    record = behind.after_inner_step(1)
    assert galaxy.averagers[1].calls == 0  # nothing was sent
    assert record["resynced"] and record["pseudo_grad_finite"] and record["outer_step"] == 3
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.125]]))
    assert record["param_hash"] == combine_hashes([ahead.state.hash()])
    assert "the galaxy is at outer step 3" in warnings[0]
    assert behind.inner_step_of_galaxy() == 3  # the trainer catches up its data and schedule from here


@pytest.mark.parametrize(
    "lead_progress, step_seconds, expected",
    [
        (
            (64, 1.0),
            0.2,
            69,
        ),  # the lead was 4 steps into the round 1 s ago: 5 more since, at our 0.2 s a step
        ((79, 2.0), 0.2, 75),  # the lead waits at the sync: stop 5 steps (4 s timeout / 4 at 0.2 s) before it
        ((64, 1.0), None, 60),  # no step time known yet: from the round's start, as before
        ((-1, 0.0), 0.2, 60),  # no record of the lead's progress
    ],
)
def test_a_cluster_that_sat_out_goes_on_where_the_galaxy_is(lead_progress, step_seconds, expected):
    # a cluster that adopted the galaxy's state at outer step 3 while the lead cluster is already training
    # towards the next sync: going on from step 60 it would reach that sync as late as it was behind, so it
    # skips ahead
    galaxy = InProcessGalaxy(1, serve_state=True)
    hv = dict(
        galaxy_size=2,
        local_steps=20,
        on_partial_round="proceed",
        join_timeout=5.0,
        averaging_timeout=4.0,
        fork_after=0.0,  # the round after the catch-up is cluster 1's alone: it commits (no quorum wait)
    )
    ahead = DiLoCo(
        linear_model([1.0]), galaxy.averager(0, 1), outer_hv(world_rank=0, **hv), warn=lambda *_: None
    )
    for step in (20, 40, 60):
        ahead.after_inner_step(step)
    galaxy.lead, galaxy.lead_progress = 3, lead_progress
    warnings: list[str] = []
    behind = DiLoCo(
        linear_model([7.0]), galaxy.averager(1, 1), outer_hv(world_rank=1, **hv), warn=warnings.append
    )
    if step_seconds is not None:
        behind.report({"step": 20, "step_seconds": step_seconds})
    record = behind.after_inner_step(20)
    assert record["resynced"] and record["outer_step"] == 3
    assert behind.inner_step_of_galaxy() == expected
    assert any("goes on from inner step" in line for line in warnings) == (expected > 60)
    record = behind.after_inner_step(80)  # the next sync: once past it, the round counter rules again
    assert record["outer_step"] == 4 and behind.inner_step_of_galaxy() == 80


@pytest.mark.parametrize(
    "own_step, expected",
    [
        (100, 75),  # past the galaxy's next sync (80): back to the lead's clock, 5 steps before its sync
        (80, 75),  # at it: its own next sync would be 100, a stride after the galaxy's
        (60, 75),  # before it: the catch-up forward, as before
        (120, 75),  # two strides past (held longer than the galaxy's rounds took): back all the same
    ],
)
def test_a_cluster_whose_clock_ran_ahead_while_it_held_goes_back_to_the_galaxys(own_step, expected):
    # a cluster that held (a minority side of a partition) kept training a stride a round without the
    # rounds' waits: at its step 100 it takes the galaxy's state at outer step 3, while the lead cluster
    # waits at the sync of round 4 (inner step 80). Going on from 100 it would sync round 4 at 120, a stride
    # after the lead gave up on it; it goes back to the galaxy's clock instead
    galaxy = InProcessGalaxy(1, serve_state=True)
    hv = dict(
        galaxy_size=2, local_steps=20, on_partial_round="proceed", join_timeout=5.0, averaging_timeout=4.0
    )
    ahead = DiLoCo(
        linear_model([1.0]), galaxy.averager(0, 1), outer_hv(world_rank=0, **hv), warn=lambda *_: None
    )
    for step in (20, 40, 60):
        ahead.after_inner_step(step)
    galaxy.lead, galaxy.lead_progress = 3, (79, 2.0)
    warnings: list[str] = []
    behind = DiLoCo(
        linear_model([7.0]), galaxy.averager(1, 1), outer_hv(world_rank=1, **hv), warn=warnings.append
    )
    behind.report({"step": 20, "step_seconds": 0.2})
    record = behind.after_inner_step(own_step)
    assert record["resynced"] and record["outer_step"] == 3
    assert behind.go_on_from(own_step) == expected
    assert any("ran past the galaxy's while it was apart" in line for line in warnings) == (own_step >= 80)
    assert behind.go_on_from(expected + 1) == expected + 1  # once: then its clock is the galaxy's


def test_out_of_sync_is_reported():
    galaxy = InProcessGalaxy(2)
    # cluster 1 starts from other weights: the hashes they exchange differ → in_sync False on both
    results = {}

    def cluster(rank):
        model = linear_model([1.0, 2.0] if rank == 0 else [1.0, 2.5])
        # join_timeout bounds cluster 1's re-sync attempt (nobody serves a state here)
        hv = outer_hv(world_rank=rank, galaxy_size=2, join_timeout=1.0)
        outer = DiLoCo(model, galaxy.averager(rank, 2), hv, warn=lambda *_: None)
        results[rank] = outer.after_inner_step(1)

    threads = [threading.Thread(target=cluster, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert results[0]["in_sync"] is False and results[1]["in_sync"] is False


class ScriptedRound(InProcessAverager):
    """A peer whose round reports what the test says (``peers`` by galaxy rank, ``stale`` ranks), leaving the
    buffer as it was, and whose state downloads answer with ``served`` (metadata, tensors) or nothing."""

    peers: dict = {}
    stale: list = []
    served = None

    def start_round(self, round_id, fingerprint, attempt=0, plan=None):
        own = {"galaxy_rank": self.rank, "round_id": round_id, **fingerprint}
        report = RoundReport(
            group_size=2, complete=True, peers={**self.peers, self.rank: own}, stale=self.stale
        )
        return types.SimpleNamespace(wait=lambda: report)

    def membership(self):
        """The serving cluster (galaxy rank 1) at the outer step of the state it serves."""
        if self.served is None:
            return super().membership()
        return Membership(steps={1: int(self.served[0]["outer_step"])}, sources={1: "1"})

    def download_state(self, timeout, source=None, holders=None):
        return self.served


def test_a_cluster_left_out_re_syncs_even_when_its_peer_was_left_out_too():
    # Seen in the e2e suite: after a round that came out partial on one side only, each cluster's shards met
    # the other's in different rounds, so one shard's reducers left cluster 0 out and another shard's left
    # cluster 1 out. Judged only against peers not left out, each found itself "in sync" with nobody and went
    # on with its own θ_outer: two models for the rest of the run. A cluster left out must adopt the
    # reference's state.
    galaxy = InProcessGalaxy(1)
    averager = ScriptedRound(galaxy, 0, 2)
    averager.peers = {1: {"galaxy_rank": 1, "round_id": 1, "param_hash": "theirs"}}
    averager.stale = [0, 1]
    reference = DiLoCo(
        linear_model([3.0, 4.0]), InProcessGalaxy(1).averager(1, 2), outer_hv(), warn=lambda *_: None
    )
    reference.state.outer_step = 2  # applied the round we were left out of
    averager.served = reference.committed.served()
    warnings: list[str] = []
    outer = DiLoCo(
        linear_model([1.0, 2.0]), averager, outer_hv(galaxy_size=2, join_timeout=1.0), warn=warnings.append
    )
    outer.state.outer_step = 1
    record = outer.after_inner_step(1)
    assert record["in_sync"] is False and record["resynced"] is True, warnings
    assert outer.outer_step == 2 and outer.state.hash() == reference.state.hash()


def test_a_re_sync_takes_the_state_a_stuck_reference_started_from():
    # the reference is a round ahead and stuck in that round (waiting on us): after --hv.join-timeout its
    # state at that round's start is adopted (the galaxy's θ_outer), not our own diverged one kept
    averager = ScriptedRound(InProcessGalaxy(1), 0, 2)
    averager.peers = {1: {"galaxy_rank": 1, "round_id": 4, "param_hash": "theirs"}}
    averager.stale = [0]
    reference = DiLoCo(
        linear_model([3.0, 4.0]), InProcessGalaxy(1).averager(1, 2), outer_hv(), warn=lambda *_: None
    )
    reference.state.outer_step = 4  # it started round 5 from here and has not applied it
    averager.served = reference.committed.served()
    warnings: list[str] = []
    outer = DiLoCo(
        linear_model([1.0, 2.0]), averager, outer_hv(galaxy_size=2, join_timeout=1.0), warn=warnings.append
    )
    outer.state.outer_step = 3
    record = outer.after_inner_step(1)
    assert record["resynced"] is True and outer.outer_step == 4, warnings
    assert outer.state.hash() == reference.state.hash()


class LosesAPartThenIsOvertaken(ScriptedRound):
    """Round 1: the other cluster's reducer never delivers our last part, so the round is partial here but
    whole there, and that cluster applies it. Our retry then looks for a group nobody else looks for, until
    the membership poll sees that cluster's record at outer step 1 (``RoundReport.overtaken``)."""

    def start_round(self, round_id, fingerprint, attempt=0, plan=None):
        self.calls += 1
        own = {"galaxy_rank": self.rank, "round_id": round_id, **fingerprint}
        if self.calls == 1:
            theirs = {**own, "galaxy_rank": 1}
            report = RoundReport(group_size=2, complete=False, peers={0: own, 1: theirs})
        else:  # its record, published after it applied the round, shows up while the retry looks for a group
            self.galaxy.lead = round_id + 1
            report = RoundReport(group_size=1, complete=True, peers={0: own}, overtaken=True)
        return types.SimpleNamespace(wait=lambda: report)

    def membership(self):
        return super().membership() if self.calls >= 2 else Membership()  # the record is not out yet


def test_a_retry_of_a_round_the_galaxy_already_applied_adopts_its_state_at_once():
    # Seen in the e2e suite (test_two_clusters_stay_bitwise_identical[fp16], under load): the retry waited for
    # the other cluster's next round, was left out of it, and re-synced a round later: two rounds lost for one
    # part
    averager = LosesAPartThenIsOvertaken(InProcessGalaxy(1), 0, 2)
    reference = DiLoCo(
        linear_model([3.0, 4.0]), InProcessGalaxy(1).averager(1, 2), outer_hv(), warn=lambda *_: None
    )
    reference.state.outer_step = 1  # applied the round whose last part we did not get
    reference.state.committed_group = [0, 1]  # ... with our Δ in it
    averager.served = reference.committed.served()
    warnings: list[str] = []
    outer = DiLoCo(
        linear_model([1.0, 2.0]), averager, outer_hv(galaxy_size=2, join_timeout=1.0), warn=warnings.append
    )
    record = outer.after_inner_step(1)
    assert averager.calls == 2, warnings  # the round and one retry: no third round started
    # our Δ is in the round the other cluster committed: taking its result is our commit too, nothing
    # re-synced
    assert record["round_outcome"] == "adopted" and record["committed"] and not record["resynced"], warnings
    assert record["outer_step"] == 1 and record["state_source"] == 1
    assert outer.state.hash() == reference.state.hash()
    assert "attempt 1/" in warnings[0] and "applied this round without this cluster" in warnings[1], warnings


def test_out_of_cohort_names_who_started_elsewhere():
    same = {"param_hash": "aa", "round_id": 4}
    # a retry of round 4 that met the next round: the peer still at round 3 is out
    assert out_of_cohort(
        {0: {**same, "galaxy_rank": 0}, 1: {"param_hash": "bb", "round_id": 3, "galaxy_rank": 1}}
    ) == {1}
    # same round, other θ_outer: the lowest galaxy rank is the reference (as for the re-sync)
    assert out_of_cohort(
        {0: {**same, "galaxy_rank": 0}, 1: {**same, "param_hash": "cc", "galaxy_rank": 1}}
    ) == {1}
    assert out_of_cohort({k: {**same, "galaxy_rank": k} for k in range(3)}) == set()
    assert (
        out_of_cohort({0: {**same, "galaxy_rank": 0}, 1: {"galaxy_rank": 1}}) == set()
    )  # no claim: the guard's
    # two sides of a healed partition at one round: the θ_outer most clusters hold is the reference, not rank
    # 0's
    three = {
        0: {**same, "param_hash": "lone", "galaxy_rank": 0},
        1: {**same, "galaxy_rank": 1},
        2: {**same, "galaxy_rank": 2},
    }
    assert out_of_cohort(three) == {0}
    # a tie of holders: the θ_outer committed by more clusters wins over the lower rank
    two = {
        0: {**same, "param_hash": "lone", "committed_by": 1, "galaxy_rank": 0},
        1: {**same, "committed_by": 3, "galaxy_rank": 1},
    }
    assert out_of_cohort(two) == {0}
    # before any of those: the chain with more committed work (a heal keeps it, whoever holds it)
    heavier = {
        **three,
        0: {**three[0], "work": 900},
        1: {**three[1], "work": 600},
        2: {**three[2], "work": 600},
    }
    assert out_of_cohort(heavier) == {1, 2}


def test_a_cluster_that_started_elsewhere_is_left_out_and_the_cohort_averages_exactly():
    """Three clusters; cluster 2 starts the round from another θ_outer. Every reducer leaves it out: clusters
    0 and 1 apply the exact mean of their own Δs (nothing of cluster 2's), and cluster 2 adopts their
    state."""
    galaxy = InProcessGalaxy(3, serve_state=True)
    results = {}
    locals_ = {0: [0.5, 2.5], 1: [0.9, 1.5], 2: [9.0, 9.0]}

    def cluster(rank):
        model = linear_model([1.0, 2.0] if rank < 2 else [5.0, 5.0])
        hv = outer_hv(world_rank=rank, galaxy_size=3, join_timeout=5.0, outer_lr=1.0, outer_momentum=0.0)
        outer = DiLoCo(model, galaxy.averager(rank, 2), hv, warn=lambda *_: None)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([locals_[rank]]))
        results[rank] = (outer.after_inner_step(1), outer.state.params.clone())

    threads = [threading.Thread(target=cluster, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    expected = torch.tensor([0.7, 2.0])  # plain averaging of clusters 0 and 1: θ_outer ← mean θ_local
    for rank in (0, 1):
        record, params = results[rank]
        assert torch.allclose(params, expected) and record["galaxy_alive"] == 3
        assert not record["resynced"]
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[2][1], results[0][1])
    assert results[2][0]["resynced"] is True


@pytest.mark.parametrize(
    "own_step, sync_started, last, expected",
    [
        (100, True, False, 60),  # two strides ahead: back to the start of the round it starts with the galaxy
        (60, True, False, None),  # on the galaxy's clock already
        (100, True, True, None),  # the run's last step: the end of the run takes the galaxy's θ anyway
        (100, False, False, 40),  # no sync started here: the catch-up target (no lead known: round 2 done)
    ],
)
def test_after_a_take_at_a_landing_the_clock_goes_back_to_the_galaxys(own_step, sync_started, last, expected):
    # τ = H/P: a landing that takes the galaxy's state (outer step 2 here) starts the next sync, round 3, in
    # step with the galaxy's (which started when round 2 landed there). A cluster whose clock ran two strides
    # ahead while it held would go on in step with the rounds but reach --max-steps two rounds before the
    # galaxy, and end on its own: it goes back to round 3's start on the galaxy's clock, inner step 60
    warnings: list[str] = []
    hv = outer_hv(galaxy_size=1, local_steps=20, sync_delay=20)
    outer = DiLoCo(linear_model([1.0]), InProcessGalaxy(1).averager(0, 1), hv, warn=warnings.append)
    outer.state.outer_step = 2  # the state it took
    outer.catch_up.took_state = True
    assert outer.catch_up.clock_after(own_step, sync_started=sync_started, last=last) == expected
    assert outer.go_on_from(own_step) == (own_step if expected is None else expected)
    assert bool(warnings) == (expected is not None)
    assert outer.catch_up.clock_after(own_step, sync_started=sync_started, last=last) is None  # once a take


@pytest.mark.parametrize("sync_delay", [0, 10, 20])
def test_a_held_round_trains_its_stride_again(sync_delay):
    # cluster 1 of two, alone (cluster 0, the roster's lowest rank, is away): no quorum, so each round holds.
    # Its clock goes back a stride each time, so the round's next attempt starts where the round did (step 20)
    # and it meets the galaxy's round there, not a stride later per hold
    warnings: list[str] = []
    hv = outer_hv(
        world_rank=1, galaxy_size=2, local_steps=20, sync_delay=sync_delay, on_partial_round="proceed"
    )
    galaxy = InProcessGalaxy(1)
    outer = DiLoCo(linear_model([1.0]), galaxy.averager(1, 1), hv, warn=warnings.append)
    step, landed = 0, []
    for _ in range(100):
        step += 1
        results = outer.syncs_after_inner_step(step)
        landed += [(step, r.outcome, r.outer_step) for r in results]
        step = outer.go_on_from(step)
        if len(landed) == 3:
            break
    assert [outcome for _, outcome, _ in landed] == ["held"] * 3
    assert [at for at, _, _ in landed] == [20 + sync_delay] * 3  # the same round's landing, each time
    assert outer.outer_step == 0 and step == sync_delay  # the clock is where round 1's stride began
    assert any("trains the stride again" in line for line in warnings)


def test_a_state_taken_at_join_leaves_no_step_of_the_checkpoint_behind_the_next_delta():
    # a by-speed cluster resumed from a checkpoint that counted 3 steps behind each fragment's next Δ takes
    # the galaxy's state as it joins: θ_local is the downloaded θ_outer, so its next Δ holds none of them (its
    # weight and its entry's steps would count them)
    galaxy = InProcessGalaxy(1, serve_state=True)
    hv = dict(galaxy_size=2, on_partial_round="proceed", outer_lr=1.0, outer_momentum=0.0, join_timeout=5.0)
    ahead_model = linear_model([1.0])
    ahead = DiLoCo(ahead_model, galaxy.averager(0, 1), outer_hv(world_rank=0, **hv), warn=lambda *_: None)
    for local in (0.5, 0.25):
        with torch.no_grad():
            ahead_model.weight.fill_(local)
        ahead.after_inner_step(1)
    setting = dict(round_steps="by-speed", local_steps=4, fragments=2, **hv)
    behind = DiLoCo(linear_model([1.0]), galaxy.averager(1, 1), outer_hv(world_rank=1, **setting), warn=print)
    behind.load_state_dict({"pace": {"planned": 2, "taken": 9, "since_sync": [3, 3]}})
    assert behind.pace.since_sync == [3, 3]
    behind.join_galaxy()
    assert behind.outer_step == 2 and behind.pace.since_sync == [0, 0]
