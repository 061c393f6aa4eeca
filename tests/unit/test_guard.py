"""The content checks of the galaxy guard: what a cluster may send, and which senders a reducer leaves out
(the reducers themselves, over real hivemind, are in tests/e2e/test_averager.py)."""

from __future__ import annotations

import pytest
import torch

from open_diloco.config import HvConfig
from open_diloco.errors import GalaxyError
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.guard import ClaimCheck, NormHistory, valid_claim, valid_weight, wire_norm
from open_diloco.outer.testing import InProcessGalaxy


def test_the_sender_bound_is_the_factor_times_the_median_of_recent_rounds():
    history = NormHistory(10.0, rounds=3)
    assert history.bound() is None  # a fresh or resumed cluster: no reference yet
    history.record([1.0, 3.0])  # round median 2
    history.record([4.0, None, float("nan"), "x"])  # only valid claims count: median 4
    history.record([])  # a round without claims adds nothing
    assert history.bound() == pytest.approx(10 * 3.0)
    for median in (5.0, 6.0, 7.0):  # only the last 3 rounds
        history.record([median])
    assert history.bound() == pytest.approx(60.0)
    assert history.bound(weight=0.5) == pytest.approx(30.0)  # a Δ of half a round's steps: half the norm
    assert NormHistory(0.0).bound() is None  # off


@pytest.mark.parametrize("claim", [None, float("nan"), float("inf"), -1.0, True, "1.0"])
def test_an_invalid_claim_is_no_claim(claim):
    assert valid_claim(claim) is None


def test_a_reducer_admits_comparable_senders_and_leaves_out_a_thousandfold_one():
    claims = {"me": 2.0, "peer": 15.0, "huge": 2000.0, "silent": None}
    check = ClaimCheck({**claims, "edge": 20.0, "past": 20.1}, "me", factor=10.0)
    assert check.admits("edge") and not check.admits("past")  # the bound: 10 x our own 2.0
    assert check.admits("me") and check.admits("peer")
    assert not check.admits("huge")  # finite, but 1000x ours
    assert not check.admits("silent") and not check.admits("stranger")  # no claim, no place in the average
    unbounded = ClaimCheck(claims, "me", factor=0.0)
    assert unbounded.admits("huge") and not unbounded.admits("silent")


def test_claims_compare_per_unit_of_weight_when_clusters_take_unequal_steps():
    """--hv.round-steps by-speed: a cluster that took all of a round's steps (weight 1) has a larger Δ than
    one that took a quarter (weight 0.25), legitimately: the bound scales with the sender's weight over
    ours."""
    claims = {"slow": 1.0, "fast": 30.0, "lying": 30.0}
    slow_reducer = ClaimCheck(claims, "slow", factor=10.0, weights={"slow": 0.25, "fast": 1.0, "lying": 0.25})
    assert slow_reducer.admits("fast")  # 30 per unit of weight vs our 4: within 10x
    assert not slow_reducer.admits("lying")  # the same Δ from a quarter of the steps: 30x ours per step
    fast_reducer = ClaimCheck({"fast": 1.0, "slow": 2.0}, "fast", factor=10.0, weights={"slow": 0.1})
    assert not fast_reducer.admits("slow")  # 20 per unit of weight vs our 1
    assert [valid_weight(w) for w in (None, 0.5, 1, 0, 1.5, float("nan"), True, "1")] == [
        1.0,
        0.5,
        1.0,
        None,
        None,
        None,
        None,
        None,
    ]


def test_a_sender_whose_parts_exceed_its_claim_is_caught():
    torch.manual_seed(0)
    delta = torch.randn(1000)
    honest = ClaimCheck({"me": 1.0, "peer": wire_norm(delta)}, "me", factor=0.0)
    assert all(honest.within_claim("peer", part) for part in delta.split(300))
    liar = ClaimCheck({"me": 1.0, "peer": wire_norm(delta) / 2}, "me", factor=0.0)
    verdicts = [liar.within_claim("peer", part) for part in delta.split(300)]
    assert verdicts[0] and not verdicts[-1]  # caught by the time its parts add up to more than the claim


def test_the_robust_mean_clips_every_sender_to_the_median_claim():
    claims = {"a": 1.0, "b": 2.0, "c": 8.0}
    check = ClaimCheck(claims, "a", factor=10.0, robust=True)
    assert [check.scale(p) for p in ("a", "b", "c")] == [1.0, 1.0, 0.25]
    assert ClaimCheck(claims, "a", factor=10.0).scale("c") == 1.0  # off: the plain mean


def _lone_cluster(**hv) -> tuple[torch.nn.Module, DiLoCo, list[str]]:
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    settings = dict(local_steps=1, outer_lr=1.0, outer_momentum=0.0, galaxy_size=1, world_rank=0, **hv)
    warnings: list[str] = []
    return (
        model,
        DiLoCo(model, InProcessGalaxy(1).averager(0, 4), HvConfig(**settings), warn=warnings.append),
        warnings,
    )


def _round(model: torch.nn.Module, outer: DiLoCo, step: float) -> dict:
    with torch.no_grad():
        model.weight.sub_(step)
    return outer.after_inner_step(1)


def test_a_cluster_whose_delta_blows_up_sends_nothing_and_goes_back_to_the_galaxy_state():
    model, outer, warnings = _lone_cluster()
    for _ in range(3):
        record = _round(model, outer, 0.01)  # Δ = 0.01 per value, ‖Δ‖ = 0.02
        assert record["pseudo_grad_in_bound"] is True
    assert record["pseudo_grad_bound"] == pytest.approx(10 * 0.02)
    before = model.weight.detach().clone()
    record = _round(model, outer, 10.0)  # finite, 1000x the galaxy's median
    assert record["pseudo_grad_in_bound"] is False and record["pseudo_grad_finite"] is True
    assert record["pseudo_grad_norm"] == pytest.approx(20.0) and record["galaxy_peers"] == 0
    assert torch.equal(model.weight.detach(), before)  # its local progress is dropped, θ_outer stays
    assert "out of bound" in warnings[-1] and "(1/3)" in warnings[-1]
    assert _round(model, outer, 0.01)["pseudo_grad_in_bound"] is True  # and it trains on


def test_a_cluster_out_of_bound_round_after_round_stops_with_one_line():
    model, outer, _ = _lone_cluster(max_bad_rounds=2)
    _round(model, outer, 0.01)
    for _ in range(2):
        assert _round(model, outer, 10.0)["pseudo_grad_in_bound"] is False
    with pytest.raises(GalaxyError, match=r"^outer step 2: .* out of bound in 3 rounds in a row"):
        _round(model, outer, 10.0)


def test_no_bound_without_history_or_when_off():
    model, outer, _ = _lone_cluster()
    assert (
        _round(model, outer, 10.0)["pseudo_grad_in_bound"] is True
    )  # the first round: nothing to compare to
    model, outer, _ = _lone_cluster(delta_norm_bound=0.0)
    _round(model, outer, 0.01)
    assert _round(model, outer, 10.0)["pseudo_grad_bound"] is None


def test_a_delta_a_hundred_times_the_weights_is_out_of_bound_from_the_first_round():
    # no history yet, but no round of training moves weights by 100x their norm: a diverged first round
    history = NormHistory(10.0)
    assert history.bound(theta_norm=2.0) == pytest.approx(200.0)
    history.record([1.0])
    assert history.bound(theta_norm=2.0) == pytest.approx(10.0)  # the tighter of the two
    assert NormHistory(0.0).bound(theta_norm=2.0) is None
    model, outer, warnings = _lone_cluster()  # θ_outer = [1, 1, 1, 1]: ‖θ‖ = 2
    record = _round(model, outer, 150.0)  # ‖Δ‖ = 300 > 100 × 2
    assert record["pseudo_grad_in_bound"] is False and record["pseudo_grad_bound"] == pytest.approx(200.0)
    assert "out of bound" in warnings[-1]


def test_a_reducer_bounds_every_claim_by_its_own_weights_too():
    claims = {"me": 5.0, "peer": 40.0}
    assert ClaimCheck({**claims, "edge": 30.0}, "me", factor=10.0, own_theta=0.3).admits("edge")  # 100 x 0.3
    assert not ClaimCheck(claims, "me", factor=10.0, own_theta=0.3).admits("peer")
    assert ClaimCheck(claims, "me", factor=10.0, own_theta=None).admits("peer")
