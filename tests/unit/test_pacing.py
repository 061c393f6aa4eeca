"""``--hv.round-steps by-speed``: which galaxy steps a slower cluster trains at, what its Δ weighs, and the
weighted average the outer step applies (in-process galaxy; tests/e2e/test_unequal_clusters.py runs it over
hivemind)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from open_diloco.config import HvConfig
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.pacing import Pace
from open_diloco.outer.testing import InProcessGalaxy
from tests.support.tiny_outer import linear_model, outer_hv


def by_speed_hv(rank: int, **settings) -> HvConfig:
    """Cluster ``rank`` of a galaxy of two with steps by speed, H = 4 and plain averaging (the outer step
    applies the weighted mean itself), and ``settings``."""
    return outer_hv(
        **{
            "world_rank": rank,
            "galaxy_size": 2,
            "local_steps": 4,
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
            "round_steps": "by-speed",
            **settings,
        }
    )


def in_threads(cluster, args_per_cluster: list[tuple], timeout: float = 60) -> None:
    """``cluster(*args)`` once per entry, each in a thread of its own, so that the clusters' rounds meet."""
    threads = [threading.Thread(target=cluster, args=args) for args in args_per_cluster]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)


def trained_steps(pace: Pace, steps: range) -> list[int]:
    return [step for step in steps if pace.trains_at(step)]


def test_a_slower_cluster_spreads_its_share_over_the_stride_and_always_trains_at_the_sync():
    pace = Pace(local_steps=10, fragments=1, by_speed=True, fixed_speed=0.5)
    assert trained_steps(pace, range(1, 21)) == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    pace.agree(3)
    assert trained_steps(pace, range(1, 11)) == [4, 7, 10]  # the sync's step (10) is always trained
    pace.agree(10)
    assert trained_steps(pace, range(1, 11)) == list(range(1, 11))
    equal = Pace(local_steps=10, fragments=1, by_speed=False, fixed_speed=0.0)
    equal.agree(3)  # equal steps train at every galaxy step, whatever is planned
    assert trained_steps(equal, range(1, 11)) == list(range(1, 11))


def test_the_plan_follows_the_fastest_cluster_and_ignores_jitter():
    pace = Pace(local_steps=20, fragments=2, by_speed=True)  # stride 10
    assert pace.plan(own_seconds=None, fastest_seconds=1.0) == 10  # nothing measured yet: every step
    assert pace.plan(own_seconds=2.0, fastest_seconds=1.0) == 5  # half speed: half the steps
    assert pace.plan(own_seconds=3.0, fastest_seconds=1.0) == 3
    assert pace.plan(own_seconds=1.05, fastest_seconds=1.0) == 10  # within the tolerance: noise, not speed
    assert pace.plan(own_seconds=100.0, fastest_seconds=1.0) == 1  # at least one step
    assert pace.plan(own_seconds=1.0, fastest_seconds=1.0) == 10  # the fastest itself
    fixed = Pace(local_steps=20, fragments=2, by_speed=True, fixed_speed=0.3)
    assert fixed.planned == 3 and fixed.plan(own_seconds=1.0, fastest_seconds=1.0) == 3


def test_each_sync_weighs_the_steps_behind_its_fragment():
    pace = Pace(local_steps=4, fragments=2, by_speed=True, fixed_speed=0.5)  # stride 2, one step each
    for step in range(1, 5):
        pace.count(pace.trains_at(step))
        if step % 2 == 0:  # a sync starts: fragment (step/2 - 1) % 2
            fragment = (step // 2 - 1) % 2
            weight = pace.weight_of(fragment)
            assert weight == (0.25 if step == 2 else 0.5), step  # fragment 0's first sync: one step so far
            pace.synced(fragment)
    assert pace.taken == 2 and pace.data_position(4) == 2
    assert Pace(4, 1, by_speed=False).weight_of(0) == 1.0


def test_the_pace_survives_a_checkpoint_and_one_saved_with_equal_steps_took_every_step():
    pace = Pace(local_steps=8, fragments=2, by_speed=True)
    pace.agree(2)
    for step in range(1, 7):
        pace.count(pace.trains_at(step))
    saved = pace.state_dict()
    again = Pace(local_steps=8, fragments=2, by_speed=True)
    again.load_state_dict(saved)
    assert again.state_dict() == saved and trained_steps(again, range(7, 9)) == trained_steps(
        pace, range(7, 9)
    )
    from_equal = Pace(local_steps=8, fragments=2, by_speed=True)
    from_equal.load_state_dict(None)  # a checkpoint of a run with equal steps
    assert from_equal.data_position(40) == 40
    assert Pace(8, 2, by_speed=False).state_dict() is None


def test_cluster_speed_needs_steps_by_speed():
    with pytest.raises(
        ValueError, match="--hv.cluster-speed 0.5 only applies with --hv.round-steps by-speed"
    ):
        outer_hv(cluster_speed=0.5)


def test_a_galaxy_of_unequal_clusters_applies_the_step_weighted_average():
    """Cluster 0 takes every step of a round of H = 4, cluster 1 (half speed) two: θ_outer moves by the
    average of their Δs weighted 1 : 0.5, on both, to the bit."""
    galaxy = InProcessGalaxy(2)
    start = torch.tensor([1.0, -2.0, 0.5])
    moves = {0: torch.tensor([0.1, 0.2, -0.3]), 1: torch.tensor([-0.4, 0.1, 0.7])}  # per inner step
    results = {}

    def cluster(rank: int, speed: float):
        model = linear_model(start.tolist())
        hv = by_speed_hv(rank, cluster_speed=speed)
        outer = DiLoCo(model, galaxy.averager(rank, 3), hv, warn=lambda *_: None)
        trained, records = 0, []
        for step in range(1, 5):
            if trains := outer.trains_at(step):
                trained += 1
                with torch.no_grad():
                    model.weight.sub_(moves[rank])
            records += [r.metrics() for r in outer.syncs_after_inner_step(step, trained=trains)]
        results[rank] = (model.weight.detach().clone(), trained, records)

    in_threads(cluster, [(0, 1.0), (1, 0.5)])
    assert [results[rank][1] for rank in (0, 1)] == [4, 2]
    deltas = {0: 4 * moves[0], 1: 2 * moves[1]}
    weighted = (1.0 * deltas[0] + 0.5 * deltas[1]) / 1.5
    assert not torch.allclose(weighted, (deltas[0] + deltas[1]) / 2)  # the weights change the result
    for rank in (0, 1):
        weight, _, (record,) = results[rank]
        torch.testing.assert_close(weight[0], start - weighted, rtol=0, atol=1e-6)
        assert (record["round_inner_steps"], record["round_weight"]) == ((4, 1.0), (2, 0.5))[rank]
    assert torch.equal(results[0][0], results[1][0])


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_unequal_clusters_stay_identical_with_fragments_a_delay_and_a_codec(compression):
    """Streaming (P = 2, τ = 1) with steps by speed: every landed sync leaves both clusters with the same
    θ_outer, and after the first period each sync weighs 1 (every step) against 0.5 (half of them)."""
    galaxy = InProcessGalaxy(2, compression=compression)
    numel = 64
    results: dict[int, list[dict]] = {}

    def cluster(rank: int, speed: float):
        generator = torch.Generator().manual_seed(rank)
        model = linear_model(torch.zeros(numel).tolist())
        hv = by_speed_hv(rank, fragments=2, sync_delay=1, compression=compression, cluster_speed=speed)
        outer = DiLoCo(model, galaxy.averager(rank, numel // 2), hv, warn=lambda *_: None)
        records = []
        for step in range(1, 17):
            if trains := outer.trains_at(step):
                with torch.no_grad():
                    model.weight.add_(0.01 * torch.randn(1, numel, generator=generator))
            records += [r.metrics() for r in outer.syncs_after_inner_step(step, step == 16, trains)]
        results[rank] = records

    in_threads(cluster, [(0, 1.0), (1, 0.5)])
    fast, slow = results[0], results[1]
    assert [r["outer_step"] for r in fast] == [r["outer_step"] for r in slow] == list(range(1, 9))
    assert [r["param_hash"] for r in fast] == [r["param_hash"] for r in slow]
    assert len({r["param_hash"] for r in fast}) == 8  # every sync moved θ_outer
    # a fragment syncs every H = 4 steps: its first sync holds the steps since the start (2 or 4 of them)
    assert [r["round_weight"] for r in fast[2:]] == [1.0] * 6
    assert [r["round_weight"] for r in slow[2:]] == [0.5] * 6


def test_a_cluster_plans_its_steps_from_the_speeds_the_galaxy_publishes():
    """Speeds measured, not given: cluster 1's inner steps take 2.5 x cluster 0's (its own records, and both
    clusters' membership records). The first stride knows no speeds and trains every step; from the first
    sync on, cluster 1 takes round(4 / 2.5) = 2 of every 4 steps and cluster 0 all of them."""
    galaxy = InProcessGalaxy(2)
    galaxy.step_seconds = {0: 0.1, 1: 0.25}
    trained: dict[int, list[int]] = {}

    def cluster(rank: int):
        model = linear_model([0.0, 0.0])
        hv = by_speed_hv(rank)
        outer = DiLoCo(model, galaxy.averager(rank, 2), hv, warn=lambda *_: None)
        steps = []
        for step in range(1, 13):
            if trains := outer.trains_at(step):
                steps.append(step)
                outer.report({"step": step, "step_seconds": galaxy.step_seconds[rank]})
            outer.syncs_after_inner_step(step, trained=trains)
        trained[rank] = steps

    in_threads(cluster, [(0,), (1,)])
    assert trained[0] == list(range(1, 13))
    assert trained[1] == [1, 2, 3, 4, 6, 8, 10, 12]


@pytest.mark.parametrize(("local_steps", "fragments"), [(8, 1), (8, 4), (10, 2), (6, 3)])
def test_equal_steps_resumed_anywhere_count_as_the_straight_run_does(local_steps, fragments):
    """A checkpoint with equal steps keeps no pace: resumed at a galaxy step, each fragment's steps since its
    last sync started come from the schedule, as the straight run counted them (the next sync's ledger entry
    names them)."""
    straight = Pace(local_steps, fragments, by_speed=False, fixed_speed=None)
    stride = local_steps // fragments
    for step in range(1, 4 * local_steps + 1):
        straight.count(trained=True)
        if step % stride == 0:
            straight.synced((step // stride - 1) % fragments)
        resumed = Pace(local_steps, fragments, by_speed=False, fixed_speed=None)
        resumed.resume_at(step)
        assert resumed.since_sync == straight.since_sync, step


def test_a_resume_with_a_round_in_flight_sends_it_again_with_its_weight():
    """Steps by speed, P = 2, τ = 1: the checkpoint after step 8 holds fragment 1's sync in flight, which the
    half-speed cluster sent with weight 0.5. Resumed there, both clusters send that round again as it was
    (before, it went out with weight 1 and the resumed galaxy left the straight run's θ) and go on bitwise
    as the straight run, ledger entries included."""
    numel, steps, saved_at, speeds = 64, 16, 8, (1.0, 0.5)
    saved: dict[int, tuple] = {}

    def run(resume: bool) -> dict[int, list[dict]]:
        galaxy, results = InProcessGalaxy(2), {}

        def cluster(rank: int):
            model = linear_model(torch.zeros(numel).tolist())
            hv = by_speed_hv(rank, fragments=2, sync_delay=1, cluster_speed=speeds[rank])
            outer = DiLoCo(model, galaxy.averager(rank, numel // 2), hv, warn=lambda *_: None)
            generator, first = torch.Generator().manual_seed(rank), 1
            if resume:
                weights, state, generator_state = saved[rank]
                with torch.no_grad():
                    model.weight.copy_(weights)
                outer.load_state_dict(copy.deepcopy(state))
                generator.set_state(generator_state)
                assert outer.join_galaxy() == saved_at - 2 and outer.in_flight is not None
                first = saved_at + 1
            records = []
            for step in range(first, steps + 1):
                if trains := outer.trains_at(step):
                    with torch.no_grad():
                        model.weight.add_(0.01 * torch.randn(1, numel, generator=generator))
                records += [
                    {**r.metrics(), "step": step}
                    for r in outer.syncs_after_inner_step(step, step == steps, trains)
                ]
                if step == saved_at and not resume:
                    assert outer.in_flight is not None
                    saved[rank] = (
                        model.weight.detach().clone(),
                        copy.deepcopy(outer.state_dict()),
                        generator.get_state(),
                    )
            results[rank] = records

        in_threads(cluster, [(0,), (1,)])
        return results

    straight, resumed = run(resume=False), run(resume=True)
    for rank in (0, 1):
        expected = [r for r in straight[rank] if r["step"] > saved_at]
        assert [r["step"] for r in resumed[rank]] == [r["step"] for r in expected]
        assert [r["param_hash"] for r in resumed[rank]] == [r["param_hash"] for r in expected]
        assert [r["round_weight"] for r in resumed[rank]] == [r["round_weight"] for r in expected]
        assert [r.get("ledger") for r in resumed[rank]] == [r.get("ledger") for r in expected]
    assert resumed[1][0]["round_weight"] == 0.5  # the round sent again: the half-speed cluster's weight
