"""The DiLoCo outer step against hand-computed numbers, with an in-process averager (no hivemind)."""

from __future__ import annotations

import contextlib
import copy
import threading
import types

import pytest
import torch

from open_diloco.config import HvConfig
from open_diloco.errors import GalaxyError, RoundFailed
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.policy import out_of_cohort
from open_diloco.outer.protocols import Membership, RoundReport
from open_diloco.outer.state import combine_hashes, outer_sgd_step_
from open_diloco.outer.testing import InProcessAverager, InProcessGalaxy


def _hv(**overrides) -> HvConfig:
    """Outer settings of the tests: the defaults, one local step, galaxy rank/size as given."""
    settings = dict(local_steps=1, outer_lr=0.7, outer_momentum=0.9, galaxy_size=1, world_rank=0)
    return HvConfig(**{**settings, **overrides})


def _model(values: list[float]) -> torch.nn.Module:
    model = torch.nn.Linear(len(values), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values]))
    return model


def _run_clusters(galaxy, starts, locals_per_round, **kwargs):
    """Each cluster starts at ``starts``, and before each round sets its local weights to the given values."""
    results = {}

    def cluster(rank: int):
        model = _model(starts)
        hv = _hv(**{"world_rank": rank, "galaxy_size": galaxy.size, **kwargs})
        outer = DiLoCo(model, galaxy.averager(rank, len(starts)), hv, warn=lambda *_: None)
        records = []
        for local in locals_per_round[rank]:
            with torch.no_grad():
                model.weight.copy_(torch.tensor([local]))
            records.append(outer.after_inner_step(1))
        results[rank] = (model.weight.detach().clone(), records, outer)

    threads = [threading.Thread(target=cluster, args=(r,)) for r in range(galaxy.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_outer_step_matches_hand_computed_nesterov():
    # θ0 = [1, 2]; round 1 locals A=[0.5, 2.5], B=[0.9, 1.5] → Δ = [0.5, −0.5], [0.1, 0.5] → avg [0.3, 0.0]
    # momentum buf = [0.3, 0]; nesterov update = g + 0.9·buf = [0.57, 0]; θ1 = θ0 − 0.7·update = [0.601, 2.0]
    # round 2 locals A=[0.401, 2.2], B=[0.601, 1.8] → Δ = [0.2, −0.2], [0, 0.2] → avg [0.1, 0.0]
    # buf = 0.9·[0.3, 0] + [0.1, 0] = [0.37, 0]; update = [0.1 + 0.333, 0] = [0.433, 0]; θ2 = [0.601 − 0.3031, 2.0]
    galaxy = InProcessGalaxy(2)
    locals_ = {0: [[0.5, 2.5], [0.401, 2.2]], 1: [[0.9, 1.5], [0.601, 1.8]]}
    results = _run_clusters(galaxy, [1.0, 2.0], locals_)
    expected = [[0.601, 2.0], [0.601 - 0.7 * 0.433, 2.0]]
    for rank in (0, 1):
        weight, records, _ = results[rank]
        torch.testing.assert_close(weight, torch.tensor([expected[1]]), rtol=0, atol=1e-6)
        assert [r["outer_step"] for r in records] == [1, 2]
        assert all(r["in_sync"] and r["galaxy_peers"] == 2 for r in records)
    assert results[0][1][-1]["param_hash"] == results[1][1][-1]["param_hash"]
    assert results[0][1][0]["param_hash"] != results[0][1][1]["param_hash"]


def test_outer_step_equals_torch_reference_over_many_rounds():
    torch.manual_seed(0)
    size, rounds = 3, 4
    start = torch.randn(64).tolist()
    locals_ = {
        r: [(torch.tensor(start) + 0.1 * torch.randn(64)).tolist() for _ in range(rounds)]
        for r in range(size)
    }
    results = _run_clusters(InProcessGalaxy(size), start, locals_)
    # reference: plain fp64 loop of the same formula
    theta = torch.tensor(start, dtype=torch.float64)
    buf = None
    for k in range(rounds):
        delta = torch.stack(
            [theta - torch.tensor(locals_[r][k], dtype=torch.float64) for r in range(size)]
        ).mean(0)
        buf = delta.clone() if buf is None else 0.9 * buf + delta
        theta = theta - 0.7 * (delta + 0.9 * buf)
    for r in range(size):
        torch.testing.assert_close(results[r][0][0].double(), theta, rtol=0, atol=1e-5)


def test_inner_steps_between_rounds_do_nothing():
    galaxy = InProcessGalaxy(1)
    averager = galaxy.averager(0, 1)
    outer = DiLoCo(_model([1.0]), averager, _hv(local_steps=5), warn=lambda *_: None)
    assert [bool(outer.after_inner_step(s)) for s in range(1, 11)] == [False] * 4 + [True] + [False] * 4 + [
        True
    ]
    assert averager.calls == 2


@pytest.mark.parametrize("policy, expected_calls", [("proceed", 1), ("retry", 3)])
def test_partial_round_policy(policy, expected_calls):
    galaxy = InProcessGalaxy(2, drop={1})
    results = _run_clusters(galaxy, [1.0], {0: [[0.0]], 1: [[0.5]]}, on_partial_round=policy, max_retries=2)
    weight, records, outer = results[0]
    assert records[0]["galaxy_peers"] == 1 and records[0]["retries"] == expected_calls - 1
    assert records[0]["in_sync"] is False  # a live cluster was missing: nobody can tell
    assert outer.averager.calls == expected_calls
    # proceeding alone: the outer step used this cluster's own Δ = 1.0 → θ = 1 − 0.7·(1 + 0.9) = −0.33
    torch.testing.assert_close(weight, torch.tensor([[1.0 - 0.7 * 1.9]]))


def test_partial_round_fail_policy_stops():
    galaxy = InProcessGalaxy(1)
    hv = _hv(galaxy_size=2, on_partial_round="fail")
    outer = DiLoCo(_model([1.0]), galaxy.averager(0, 1), hv, warn=lambda *_: None)
    with pytest.raises(GalaxyError, match="only 1 of 2 live clusters"):
        outer.after_inner_step(1)


def test_the_only_live_cluster_averages_alone_at_once():
    # the other cluster's membership record says it left: no matchmaking (which could only time out), no retry,
    # not even under `fail`; the outer step uses this cluster's own Δ
    galaxy = InProcessGalaxy(1, departed={1})
    warnings: list[str] = []
    model = _model([1.0])
    hv = _hv(galaxy_size=2, on_partial_round="fail", outer_lr=1.0, outer_momentum=0.0)
    outer = DiLoCo(model, galaxy.averager(0, 1), hv, warn=warnings.append)
    with torch.no_grad():
        model.weight.fill_(0.5)
    record = outer.after_inner_step(1)
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.5]]))  # θ_outer ← own θ_local
    assert outer.averager.calls == 0
    assert (record["galaxy_peers"], record["galaxy_alive"], record["retries"]) == (1, 1, 0) and record["in_sync"]
    assert warnings == ["outer step 1: 1 of 2 clusters alive (were 2): rounds now wait for these"]
    outer.after_inner_step(1)
    assert len(warnings) == 1  # said once, when the live set changed


@pytest.mark.parametrize("left", ["said it ended", "fell silent"])
def test_a_cluster_alone_is_in_sync_only_when_the_others_said_they_ended(left):
    # a cluster that fell silent may be training on behind a partition: alone, nothing was compared, so the round
    # must not claim the galaxy agrees (both sides of a cut logged in_sync True while they drifted apart)
    galaxy = InProcessGalaxy(1, departed={1}, silent={1} if left == "fell silent" else set())
    outer = DiLoCo(_model([1.0]), galaxy.averager(0, 1), _hv(galaxy_size=2), warn=lambda *_: None)
    record = outer.after_inner_step(1)
    assert (record["galaxy_peers"], record["galaxy_alive"]) == (1, 1)
    assert record["in_sync"] is (left == "said it ended")


def test_a_round_of_every_live_cluster_is_complete():
    # galaxy of 3, cluster 2 gone: the two live clusters' round is whole (no retry), and averages the two
    galaxy = InProcessGalaxy(2, departed={2})
    results = _run_clusters(galaxy, [1.0], {0: [[0.0]], 1: [[0.5]]}, galaxy_size=3, outer_lr=1.0,
                            outer_momentum=0.0, on_partial_round="retry")
    for rank in (0, 1):
        weight, records, outer = results[rank]
        assert (records[0]["galaxy_peers"], records[0]["galaxy_alive"], records[0]["retries"]) == (2, 2, 0)
        assert outer.averager.calls == 1
        torch.testing.assert_close(weight, torch.tensor([[0.25]]))


def test_a_diverged_cluster_sends_nothing_and_adopts_the_galaxy_state():
    # clusters 0 and 1 average; cluster 2's training diverged (NaN weights): it must not send (one NaN Δ makes
    # every cluster's θ_outer NaN), and heals by adopting the galaxy's θ_outer once their round is applied
    galaxy = InProcessGalaxy(2, serve_state=True)
    hv = dict(galaxy_size=3, outer_lr=1.0, outer_momentum=0.0, on_partial_round="proceed", join_timeout=10.0)
    warnings: list[str] = []
    model = _model([1.0])
    diverged = DiLoCo(model, galaxy.averager(2, 1), _hv(world_rank=2, **hv), warn=warnings.append)
    results = {}

    def healthy(rank: int, local: float):
        healthy_model = _model([1.0])
        outer = DiLoCo(healthy_model, galaxy.averager(rank, 1), _hv(world_rank=rank, **hv), warn=lambda *_: None)
        with torch.no_grad():
            healthy_model.weight.fill_(local)
        results[rank] = outer.after_inner_step(1), healthy_model.weight.detach().clone()

    with torch.no_grad():
        model.weight.fill_(float("nan"))
    threads = [threading.Thread(target=healthy, args=(rank, local)) for rank, local in ((0, 0.0), (1, 0.5))]
    for thread in threads:
        thread.start()
    record = diverged.after_inner_step(1)
    for thread in threads:
        thread.join(timeout=30)
    for rank in (0, 1):
        assert results[rank][0]["galaxy_peers"] == 2 and results[rank][0]["pseudo_grad_finite"]
        torch.testing.assert_close(results[rank][1], torch.tensor([[0.25]]))  # the mean of the two finite Δ
    assert galaxy.averagers[2].calls == 0  # nothing was sent
    assert record["pseudo_grad_finite"] is False and record["resynced"] and record["outer_step"] == 1
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.25]]))  # healed: the galaxy's θ_outer
    assert record["param_hash"] == results[0][0]["param_hash"]
    assert "pseudo-gradient is not finite" in warnings[0] and "adopted cluster 0's state" in warnings[1]


def test_a_cluster_behind_the_galaxy_sends_nothing_and_adopts_its_state():
    # the membership records show a live cluster at outer step 3 while this one is at 0 (say, a late joiner whose
    # download is already old): its Δ comes from an older θ_outer and must never enter the average
    galaxy = InProcessGalaxy(1, serve_state=True)
    hv = dict(galaxy_size=2, on_partial_round="proceed", outer_lr=1.0, outer_momentum=0.0, join_timeout=5.0)
    ahead_model = _model([1.0])
    ahead = DiLoCo(ahead_model, galaxy.averager(0, 1), _hv(world_rank=0, **hv), warn=lambda *_: None)
    for local in (0.5, 0.25, 0.125):
        with torch.no_grad():
            ahead_model.weight.fill_(local)
        ahead.after_inner_step(1)
    galaxy.lead = 3
    warnings: list[str] = []
    model = _model([1.0])
    behind = DiLoCo(model, galaxy.averager(1, 1), _hv(world_rank=1, **hv), warn=warnings.append)
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
        ((64, 1.0), 0.2, 69),  # the lead was 4 steps into the round 1 s ago: 5 more since, at our 0.2 s a step
        ((79, 2.0), 0.2, 75),  # the lead waits at the sync: stop 5 steps (4 s timeout / 4 at 0.2 s) before it
        ((64, 1.0), None, 60),  # no step time known yet: from the round's start, as before
        ((-1, 0.0), 0.2, 60),  # no record of the lead's progress
    ],
)
def test_a_cluster_that_sat_out_goes_on_where_the_galaxy_is(lead_progress, step_seconds, expected):
    # a cluster that adopted the galaxy's state at outer step 3 while the lead cluster is already training towards
    # the next sync: going on from step 60 it would reach that sync as late as it was behind, so it skips ahead
    galaxy = InProcessGalaxy(1, serve_state=True)
    hv = dict(galaxy_size=2, local_steps=20, on_partial_round="proceed", join_timeout=5.0, averaging_timeout=4.0)
    ahead = DiLoCo(_model([1.0]), galaxy.averager(0, 1), _hv(world_rank=0, **hv), warn=lambda *_: None)
    for step in (20, 40, 60):
        ahead.after_inner_step(step)
    galaxy.lead, galaxy.lead_progress = 3, lead_progress
    warnings: list[str] = []
    behind = DiLoCo(_model([7.0]), galaxy.averager(1, 1), _hv(world_rank=1, **hv), warn=warnings.append)
    if step_seconds is not None:
        behind.report({"step": 20, "step_seconds": step_seconds})
    record = behind.after_inner_step(20)
    assert record["resynced"] and record["outer_step"] == 3
    assert behind.inner_step_of_galaxy() == expected
    assert any("goes on from inner step" in line for line in warnings) == (expected > 60)
    record = behind.after_inner_step(80)  # the next sync: once past it, the round counter rules again
    assert record["outer_step"] == 4 and behind.inner_step_of_galaxy() == 80


def test_a_cluster_that_keeps_diverging_stops_with_one_line():
    model = _model([1.0])
    outer = DiLoCo(model, InProcessGalaxy(1).averager(0, 1), _hv(max_bad_rounds=2), warn=lambda *_: None)
    for _ in range(2):  # alone: it drops the diverged local progress and goes back to its own θ_outer
        with torch.no_grad():
            model.weight.fill_(float("inf"))
        assert outer.after_inner_step(1)["pseudo_grad_finite"] is False
        torch.testing.assert_close(model.weight.detach(), torch.tensor([[1.0]]))
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    with pytest.raises(GalaxyError, match="not finite in 3 rounds in a row"):
        outer.after_inner_step(1)


def test_a_non_finite_pseudo_gradient_is_not_encoded_and_leaves_the_error_feedback_alone():
    # the codecs refuse non-finite input: a diverged round must never reach them (nor the error feedback)
    model = _model([1.0, 2.0, 3.0, 4.0])
    hv = _hv(compression="int8", outer_lr=1.0, outer_momentum=0.0)
    outer = DiLoCo(model, InProcessGalaxy(1, compression="int8").averager(0, 4), hv, warn=lambda *_: None)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, float("nan"), 3.0, 4.0]]))
    assert outer.after_inner_step(1)["pseudo_grad_finite"] is False
    assert torch.equal(outer.state.error, torch.zeros(4))
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[1.0, 2.0, 3.0, 4.0]]))


def test_a_good_round_resets_the_count_of_diverged_rounds():
    model = _model([1.0])
    outer = DiLoCo(model, InProcessGalaxy(1).averager(0, 1), _hv(max_bad_rounds=1), warn=lambda *_: None)
    for local in (float("nan"), 0.5, float("nan"), 0.25):
        with torch.no_grad():
            model.weight.fill_(local)
        outer.after_inner_step(1)  # never two bad rounds in a row: never stops


def test_a_non_finite_average_is_never_applied():
    class GarbageAverage(InProcessAverager):  # a peer reduced our span into NaN
        def start_round(self, round_id, fingerprint, attempt=0):
            pending = super().start_round(round_id, fingerprint, attempt)
            wait = pending.wait

            def poisoned():
                report = wait()
                self.values.fill_(float("nan"))
                return report

            pending.wait = poisoned
            return pending

    galaxy = InProcessGalaxy(1)
    warnings: list[str] = []
    model = _model([1.0])
    outer = DiLoCo(model, GarbageAverage(galaxy, 0, 1), _hv(outer_lr=1.0, outer_momentum=0.0), warn=warnings.append)
    with torch.no_grad():
        model.weight.fill_(0.5)
    record = outer.after_inner_step(1)
    assert record["average_finite"] is False and "not applied" in warnings[0]
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.5]]))  # its own Δ, never NaN


def test_a_round_still_holding_the_buffer_stops_with_one_line():
    # The round's result never came and hivemind still holds the buffer past its timeout: nothing can be applied.
    class StuckAfterStart(InProcessAverager):
        @contextlib.contextmanager
        def buffer(self):
            if self.calls:
                raise RoundFailed("the averager is still busy with a previous round")
            yield self.values

    outer = DiLoCo(_model([1.0]), StuckAfterStart(InProcessGalaxy(1), 0, 1), _hv(), warn=lambda *_: None)
    with pytest.raises(GalaxyError, match=r"^outer step 1: the averager is still busy .*resume from the last"):
        outer.after_inner_step(1)


def test_out_of_sync_is_reported():
    galaxy = InProcessGalaxy(2)
    # cluster 1 starts from other weights: the hashes they exchange differ → in_sync False on both
    results = {}

    def cluster(rank):
        model = _model([1.0, 2.0] if rank == 0 else [1.0, 2.5])
        # join_timeout bounds cluster 1's re-sync attempt (nobody serves a state here)
        hv = _hv(world_rank=rank, galaxy_size=2, join_timeout=1.0)
        outer = DiLoCo(model, galaxy.averager(rank, 2), hv, warn=lambda *_: None)
        results[rank] = outer.after_inner_step(1)

    threads = [threading.Thread(target=cluster, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert results[0]["in_sync"] is False and results[1]["in_sync"] is False


class ScriptedRound(InProcessAverager):
    """A peer whose round reports what the test says (``peers`` by galaxy rank, ``stale`` ranks), leaving the buffer
    as it was, and whose state downloads answer with ``served`` (metadata, tensors) or nothing."""

    peers: dict = {}
    stale: list = []
    served = None

    def start_round(self, round_id, fingerprint, attempt=0):
        own = {"galaxy_rank": self.rank, "round_id": round_id, **fingerprint}
        report = RoundReport(group_size=2, complete=True, peers={**self.peers, self.rank: own}, stale=self.stale)
        return types.SimpleNamespace(wait=lambda: report)

    def membership(self):
        """The serving cluster (galaxy rank 1) at the outer step of the state it serves."""
        if self.served is None:
            return super().membership()
        return Membership(steps={1: int(self.served[0]["outer_step"])}, sources={1: "1"})

    def download_state(self, timeout, source=None):
        return self.served


def test_a_cluster_left_out_re_syncs_even_when_its_peer_was_left_out_too():
    # Seen in the e2e suite: after a round that came out partial on one side only, each cluster's shards met the
    # other's in different rounds, so one shard's reducers left cluster 0 out and another shard's left cluster 1
    # out. Judged only against peers not left out, each found itself "in sync" with nobody and went on with its
    # own θ_outer: two models for the rest of the run. A cluster left out must adopt the reference's state.
    galaxy = InProcessGalaxy(1)
    averager = ScriptedRound(galaxy, 0, 2)
    averager.peers = {1: {"galaxy_rank": 1, "round_id": 1, "param_hash": "theirs"}}
    averager.stale = [0, 1]
    reference = DiLoCo(_model([3.0, 4.0]), InProcessGalaxy(1).averager(1, 2), _hv(), warn=lambda *_: None)
    reference.state.outer_step = 2  # applied the round we were left out of
    averager.served = reference._served_state()
    warnings: list[str] = []
    outer = DiLoCo(_model([1.0, 2.0]), averager, _hv(galaxy_size=2, join_timeout=1.0), warn=warnings.append)
    outer.state.outer_step = 1
    record = outer.after_inner_step(1)
    assert record["in_sync"] is False and record["resynced"] is True, warnings
    assert outer.outer_step == 2 and outer.state.hash() == reference.state.hash()


def test_a_re_sync_takes_the_state_a_stuck_reference_started_from():
    # the reference is a round ahead and stuck in that round (waiting on us): after --hv.join-timeout its state at
    # that round's start is adopted (the galaxy's θ_outer), not our own diverged one kept
    averager = ScriptedRound(InProcessGalaxy(1), 0, 2)
    averager.peers = {1: {"galaxy_rank": 1, "round_id": 4, "param_hash": "theirs"}}
    averager.stale = [0]
    reference = DiLoCo(_model([3.0, 4.0]), InProcessGalaxy(1).averager(1, 2), _hv(), warn=lambda *_: None)
    reference.state.outer_step = 4  # it started round 5 from here and has not applied it
    averager.served = reference._served_state()
    warnings: list[str] = []
    outer = DiLoCo(_model([1.0, 2.0]), averager, _hv(galaxy_size=2, join_timeout=1.0), warn=warnings.append)
    outer.state.outer_step = 3
    record = outer.after_inner_step(1)
    assert record["resynced"] is True and outer.outer_step == 4, warnings
    assert outer.state.hash() == reference.state.hash()


class LosesAPartThenIsOvertaken(ScriptedRound):
    """Round 1: the other cluster's reducer never delivers our last part, so the round is partial here but whole
    there, and that cluster applies it. Our retry then looks for a group nobody else looks for, until the
    membership poll sees that cluster's record at outer step 1 (``RoundReport.overtaken``)."""

    def start_round(self, round_id, fingerprint, attempt=0):
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
    # the other cluster's next round, was left out of it, and re-synced a round later: two rounds lost for one part
    averager = LosesAPartThenIsOvertaken(InProcessGalaxy(1), 0, 2)
    reference = DiLoCo(_model([3.0, 4.0]), InProcessGalaxy(1).averager(1, 2), _hv(), warn=lambda *_: None)
    reference.state.outer_step = 1  # applied the round whose last part we did not get
    reference.state.committed_group = [0, 1]  # ... with our Δ in it
    averager.served = reference._served_state()
    warnings: list[str] = []
    outer = DiLoCo(_model([1.0, 2.0]), averager, _hv(galaxy_size=2, join_timeout=1.0), warn=warnings.append)
    record = outer.after_inner_step(1)
    assert averager.calls == 2, warnings  # the round and one retry: no third round started
    # our Δ is in the round the other cluster committed: taking its result is our commit too, nothing re-synced
    assert record["round_outcome"] == "adopted" and record["committed"] and not record["resynced"], warnings
    assert record["outer_step"] == 1 and record["state_source"] == 1
    assert outer.state.hash() == reference.state.hash()
    assert "attempt 1/" in warnings[0] and "applied this round without this cluster" in warnings[1], warnings


def test_out_of_cohort_names_who_started_elsewhere():
    same = {"param_hash": "aa", "round_id": 4}
    # a retry of round 4 that met the next round: the peer still at round 3 is out
    assert out_of_cohort({0: {**same, "galaxy_rank": 0}, 1: {"param_hash": "bb", "round_id": 3, "galaxy_rank": 1}}) == {1}
    # same round, other θ_outer: the lowest galaxy rank is the reference (as for the re-sync)
    assert out_of_cohort({0: {**same, "galaxy_rank": 0}, 1: {**same, "param_hash": "cc", "galaxy_rank": 1}}) == {1}
    assert out_of_cohort({k: {**same, "galaxy_rank": k} for k in range(3)}) == set()
    assert out_of_cohort({0: {**same, "galaxy_rank": 0}, 1: {"galaxy_rank": 1}}) == set()  # no claim: the guard's
    # two sides of a healed partition at one round: the θ_outer most clusters hold is the reference, not rank 0's
    three = {0: {**same, "param_hash": "lone", "galaxy_rank": 0}, 1: {**same, "galaxy_rank": 1},
             2: {**same, "galaxy_rank": 2}}
    assert out_of_cohort(three) == {0}
    # a tie of holders: the θ_outer committed by more clusters wins over the lower rank
    two = {0: {**same, "param_hash": "lone", "committed_by": 1, "galaxy_rank": 0},
           1: {**same, "committed_by": 3, "galaxy_rank": 1}}
    assert out_of_cohort(two) == {0}


def test_a_cluster_that_started_elsewhere_is_left_out_and_the_cohort_averages_exactly():
    """Three clusters; cluster 2 starts the round from another θ_outer. Every reducer leaves it out: clusters 0 and
    1 apply the exact mean of their own Δs (nothing of cluster 2's), and cluster 2 adopts their state."""
    galaxy = InProcessGalaxy(3, serve_state=True)
    results = {}
    locals_ = {0: [0.5, 2.5], 1: [0.9, 1.5], 2: [9.0, 9.0]}

    def cluster(rank):
        model = _model([1.0, 2.0] if rank < 2 else [5.0, 5.0])
        hv = _hv(world_rank=rank, galaxy_size=3, join_timeout=5.0, outer_lr=1.0, outer_momentum=0.0)
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


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_sgd_is_torch_sgd_bit_for_bit(nesterov):
    """The in-place outer step (no full-size temporary) equals torch.optim.SGD exactly, round after round."""
    torch.manual_seed(0)
    ours = torch.randn(1000)
    reference = torch.nn.Parameter(ours.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=nesterov)
    buffer = None
    for _ in range(5):
        grad = torch.randn(1000)
        reference.grad = grad.clone()
        sgd.step()
        buffer = outer_sgd_step_(ours, grad, buffer, lr=0.7, momentum=0.9, nesterov=nesterov)
        assert torch.equal(ours, reference.detach())


def test_outer_momentum_zero_is_plain_sgd():
    # θ = 1, Δ = 0.25 every round: momentum 0 is θ ← θ − lr·Δ (lr 1: plain averaging, θ ← θ_local)
    params, momentum = torch.tensor([1.0]), None
    momentum = outer_sgd_step_(params, torch.tensor([0.25]), momentum, lr=1.0, momentum=0.0, nesterov=True)
    assert momentum is None and params.item() == 0.75
    results = _run_clusters(InProcessGalaxy(1), [1.0], {0: [[0.5], [0.25]]}, outer_lr=1.0, outer_momentum=0.0)
    assert results[0][0].item() == 0.25  # plain averaging of one cluster: θ_outer follows θ_local


def test_heavy_ball_momentum_hand_computed():
    # θ0 = 1; one cluster; locals 0.5 then 0.3 (Δ1 = 0.5, Δ2 = θ1 − 0.3)
    # round 1: b = 0.5, θ1 = 1 − 0.7·0.5 = 0.65; round 2: Δ2 = 0.35, b = 0.9·0.5 + 0.35 = 0.8, θ2 = 0.65 − 0.56
    results = _run_clusters(InProcessGalaxy(1), [1.0], {0: [[0.5], [0.3]]}, outer_nesterov=False)
    weight, _, outer = results[0]
    assert weight.item() == pytest.approx(0.09, abs=1e-6)
    assert outer.state.momentum_buffer.item() == pytest.approx(0.8, abs=1e-6)


def test_outer_lr_above_one_extrapolates_the_average():
    # plain averaging scaled by 1.5: θ0 = 1, locals A = 0.4, B = 0.6 → Δ̄ = 0.5 → θ1 = 1 − 1.5·0.5 = 0.25
    results = _run_clusters(
        InProcessGalaxy(2), [1.0], {0: [[0.4]], 1: [[0.6]]}, outer_lr=1.5, outer_momentum=0.0
    )
    for rank in (0, 1):
        weight, _, outer = results[rank]
        assert weight.item() == pytest.approx(0.25, abs=1e-7)
        assert outer.state.momentum_buffer is None


def test_outer_warmup_schedule():
    from open_diloco.outer.state import round_hparams

    table = [round_hparams(k, lr=0.7, momentum=0.9, warmup_rounds=2) for k in (1, 2, 3, 10)]
    assert table == [(1.0, 0.0), (0.85, 0.45), (0.7, 0.9), (0.7, 0.9)]
    assert round_hparams(1, lr=0.7, momentum=0.9, warmup_rounds=0) == (0.7, 0.9)


def test_outer_warmup_hand_computed():
    # warm-up 2 rounds to lr 0.7, Nesterov 0.9; θ0 = 1, one cluster
    # round 1 (lr 1, μ 0): Δ = 0.5 → θ1 = 0.5, no momentum yet
    # round 2 (lr 0.85, μ 0.45): local 0.3 → Δ = 0.2, b = 0.2, update 0.2 + 0.45·0.2 = 0.29, θ2 = 0.5 − 0.2465
    # round 3 (lr 0.7, μ 0.9): local θ2 − 0.1 → Δ = 0.1, b = 0.9·0.2 + 0.1 = 0.28, update 0.1 + 0.252 = 0.352,
    #   θ3 = 0.2535 − 0.2464 = 0.0071
    locals_ = [[0.5], [0.3], [0.2535 - 0.1]]
    results = _run_clusters(InProcessGalaxy(1), [1.0], {0: locals_}, outer_warmup_rounds=2)
    weight, records, outer = results[0]
    assert weight.item() == pytest.approx(0.0071, abs=1e-6)
    assert outer.state.momentum_buffer.item() == pytest.approx(0.28, abs=1e-6)
    assert [r["outer_step"] for r in records] == [1, 2, 3]


def _three_rounds(outer: DiLoCo, model: torch.nn.Module, rounds: range) -> None:
    for k in rounds:
        with torch.no_grad():
            model.weight.sub_(0.1 * k * torch.arange(1.0, 4.0))
        outer.after_inner_step(1)


@pytest.mark.parametrize(
    "settings",
    [dict(outer_warmup_rounds=2), dict(outer_momentum=0.0, outer_lr=1.3), dict(outer_nesterov=False)],
)
def test_resume_from_outer_state_is_bit_exact(settings):
    """What a checkpoint keeps (θ_outer in the model, the outer state dict: momentum, round counter) continues the
    outer schedule exactly, also when saved after a warm-up round that has no momentum yet."""
    hv = _hv(**settings)
    model = _model([1.0, 2.0, 3.0])
    straight = DiLoCo(model, InProcessGalaxy(1).averager(0, 3), hv, warn=lambda *_: None)
    _three_rounds(straight, model, range(1, 4))

    model = _model([1.0, 2.0, 3.0])
    first = DiLoCo(model, InProcessGalaxy(1).averager(0, 3), hv, warn=lambda *_: None)
    _three_rounds(first, model, range(1, 2))
    saved_weights = model.weight.detach().clone()
    saved_state = copy.deepcopy(first.state_dict())
    resumed_model = _model(saved_weights[0].tolist())
    resumed = DiLoCo(resumed_model, InProcessGalaxy(1).averager(0, 3), hv, warn=lambda *_: None)
    resumed.load_state_dict(saved_state)
    _three_rounds(resumed, resumed_model, range(2, 4))
    assert torch.equal(resumed.state.params, straight.state.params)
    assert resumed.outer_step == straight.outer_step == 3


def test_outer_momentum_zero_trains():
    """A galaxy of two clusters with --hv.outer-momentum 0 (plain averaging) trains a small regression: the
    loss falls by orders of magnitude and the clusters stay bitwise equal."""
    torch.manual_seed(0)
    target = torch.randn(8, 1)
    inputs = [torch.randn(256, 8) for _ in range(2)]
    start = torch.nn.Linear(8, 1, bias=False).weight.detach()  # made here: the RNG is shared by the threads
    results = {}

    def cluster(rank: int):
        model = _model(start[0].tolist())
        hv = _hv(world_rank=rank, galaxy_size=2, local_steps=5, outer_lr=1.0, outer_momentum=0.0)
        outer = DiLoCo(model, galaxy.averager(rank, 8), hv, warn=lambda *_: None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
        losses = []
        for step in range(1, 101):
            x = inputs[rank][(step * 16) % 256 :][:16]
            loss = torch.nn.functional.mse_loss(model(x), x @ target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            outer.after_inner_step(step)
        results[rank] = (losses, outer.state.params.clone())

    galaxy = InProcessGalaxy(2)
    threads = [threading.Thread(target=cluster, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=60) for t in threads]
    losses, params = results[0]
    assert losses[-1] < losses[0] / 100
    assert torch.equal(params, results[1][1])
