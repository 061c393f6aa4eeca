"""The DiLoCo outer step against hand-computed numbers, with an in-process averager (no hivemind). A cluster
whose round or training went wrong: test_diloco_divergence.py; one behind or apart from the galaxy:
test_diloco_resync.py."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from open_diloco.errors import GalaxyError
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.optimizer import outer_sgd_step_
from open_diloco.outer.testing import InProcessGalaxy
from tests.support.tiny_outer import linear_model, outer_hv, run_clusters


def test_outer_step_matches_hand_computed_nesterov():
    # θ0 = [1, 2]; round 1 locals A=[0.5, 2.5], B=[0.9, 1.5] → Δ = [0.5, −0.5], [0.1, 0.5] → avg [0.3, 0.0]
    # momentum buf = [0.3, 0]; nesterov update = g + 0.9·buf = [0.57, 0]; θ1 = θ0 − 0.7·update = [0.601, 2.0]
    # round 2 locals A=[0.401, 2.2], B=[0.601, 1.8] → Δ = [0.2, −0.2], [0, 0.2] → avg [0.1, 0.0]
    # buf = 0.9·[0.3, 0] + [0.1, 0] = [0.37, 0]; update = [0.1 + 0.333, 0] = [0.433, 0]; θ2 = [0.601 − 0.3031,
    # 2.0]
    galaxy = InProcessGalaxy(2)
    locals_ = {0: [[0.5, 2.5], [0.401, 2.2]], 1: [[0.9, 1.5], [0.601, 1.8]]}
    results = run_clusters(galaxy, [1.0, 2.0], locals_)
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
    results = run_clusters(InProcessGalaxy(size), start, locals_)
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
    outer = DiLoCo(linear_model([1.0]), averager, outer_hv(local_steps=5), warn=lambda *_: None)
    assert [bool(outer.after_inner_step(s)) for s in range(1, 11)] == [False] * 4 + [True] + [False] * 4 + [
        True
    ]
    assert averager.calls == 2


@pytest.mark.parametrize("policy, expected_calls", [("proceed", 1), ("retry", 3)])
def test_partial_round_policy(policy, expected_calls):
    galaxy = InProcessGalaxy(2, drop={1})
    results = run_clusters(galaxy, [1.0], {0: [[0.0]], 1: [[0.5]]}, on_partial_round=policy, max_retries=2)
    weight, records, outer = results[0]
    assert records[0]["galaxy_peers"] == 1 and records[0]["retries"] == expected_calls - 1
    assert records[0]["in_sync"] is False  # a live cluster was missing: nobody can tell
    assert outer.averager.calls == expected_calls
    # proceeding alone: the outer step used this cluster's own Δ = 1.0 → θ = 1 − 0.7·(1 + 0.9) = −0.33
    torch.testing.assert_close(weight, torch.tensor([[1.0 - 0.7 * 1.9]]))


def test_partial_round_fail_policy_stops():
    galaxy = InProcessGalaxy(1)
    hv = outer_hv(galaxy_size=2, on_partial_round="fail")
    outer = DiLoCo(linear_model([1.0]), galaxy.averager(0, 1), hv, warn=lambda *_: None)
    with pytest.raises(GalaxyError, match="only 1 of 2 live clusters"):
        outer.after_inner_step(1)


def test_the_only_live_cluster_averages_alone_at_once():
    # the other cluster's membership record says it left: no matchmaking (which could only time out), no
    # retry, not even under `fail`; the outer step uses this cluster's own Δ
    galaxy = InProcessGalaxy(1, departed={1})
    warnings: list[str] = []
    model = linear_model([1.0])
    hv = outer_hv(galaxy_size=2, on_partial_round="fail", outer_lr=1.0, outer_momentum=0.0)
    outer = DiLoCo(model, galaxy.averager(0, 1), hv, warn=warnings.append)
    with torch.no_grad():
        model.weight.fill_(0.5)
    record = outer.after_inner_step(1)
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.5]]))  # θ_outer ← own θ_local
    assert outer.averager.calls == 0
    assert (record["galaxy_peers"], record["galaxy_alive"], record["retries"]) == (1, 1, 0) and record[
        "in_sync"
    ]
    assert warnings == ["outer step 1: 1 of 2 clusters alive (were 2): rounds now wait for these"]
    outer.after_inner_step(1)
    assert len(warnings) == 1  # said once, when the live set changed


@pytest.mark.parametrize("left", ["said it ended", "fell silent"])
def test_a_cluster_alone_is_in_sync_only_when_the_others_said_they_ended(left):
    # a cluster that fell silent may be training on behind a partition: alone, nothing was compared, so the
    # round must not claim the galaxy agrees (both sides of a cut logged in_sync True while they drifted
    # apart)
    galaxy = InProcessGalaxy(1, departed={1}, silent={1} if left == "fell silent" else set())
    outer = DiLoCo(linear_model([1.0]), galaxy.averager(0, 1), outer_hv(galaxy_size=2), warn=lambda *_: None)
    record = outer.after_inner_step(1)
    assert (record["galaxy_peers"], record["galaxy_alive"]) == (1, 1)
    assert record["in_sync"] is (left == "said it ended")


def test_a_round_of_every_live_cluster_is_complete():
    # galaxy of 3, cluster 2 gone: the two live clusters' round is whole (no retry), and averages the two
    galaxy = InProcessGalaxy(2, departed={2})
    results = run_clusters(
        galaxy,
        [1.0],
        {0: [[0.0]], 1: [[0.5]]},
        galaxy_size=3,
        outer_lr=1.0,
        outer_momentum=0.0,
        on_partial_round="retry",
    )
    for rank in (0, 1):
        weight, records, outer = results[rank]
        assert (records[0]["galaxy_peers"], records[0]["galaxy_alive"], records[0]["retries"]) == (2, 2, 0)
        assert outer.averager.calls == 1
        torch.testing.assert_close(weight, torch.tensor([[0.25]]))


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
    results = run_clusters(InProcessGalaxy(1), [1.0], {0: [[0.5], [0.25]]}, outer_lr=1.0, outer_momentum=0.0)
    assert results[0][0].item() == 0.25  # plain averaging of one cluster: θ_outer follows θ_local


def test_heavy_ball_momentum_hand_computed():
    # θ0 = 1; one cluster; locals 0.5 then 0.3 (Δ1 = 0.5, Δ2 = θ1 − 0.3)
    # round 1: b = 0.5, θ1 = 1 − 0.7·0.5 = 0.65; round 2: Δ2 = 0.35, b = 0.9·0.5 + 0.35 = 0.8, θ2 = 0.65 −
    # 0.56
    results = run_clusters(InProcessGalaxy(1), [1.0], {0: [[0.5], [0.3]]}, outer_nesterov=False)
    weight, _, outer = results[0]
    assert weight.item() == pytest.approx(0.09, abs=1e-6)
    assert outer.state.momentum_buffer.item() == pytest.approx(0.8, abs=1e-6)


def test_outer_lr_above_one_extrapolates_the_average():
    # plain averaging scaled by 1.5: θ0 = 1, locals A = 0.4, B = 0.6 → Δ̄ = 0.5 → θ1 = 1 − 1.5·0.5 = 0.25
    results = run_clusters(
        InProcessGalaxy(2), [1.0], {0: [[0.4]], 1: [[0.6]]}, outer_lr=1.5, outer_momentum=0.0
    )
    for rank in (0, 1):
        weight, _, outer = results[rank]
        assert weight.item() == pytest.approx(0.25, abs=1e-7)
        assert outer.state.momentum_buffer is None


def test_outer_warmup_schedule():
    from open_diloco.outer.optimizer import round_hparams

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
    results = run_clusters(InProcessGalaxy(1), [1.0], {0: locals_}, outer_warmup_rounds=2)
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
    """What a checkpoint keeps (θ_outer in the model, the outer state dict: momentum, round counter) continues
    the outer schedule exactly, also when saved after a warm-up round that has no momentum yet."""
    hv = outer_hv(**settings)
    model = linear_model([1.0, 2.0, 3.0])
    straight = DiLoCo(model, InProcessGalaxy(1).averager(0, 3), hv, warn=lambda *_: None)
    _three_rounds(straight, model, range(1, 4))

    model = linear_model([1.0, 2.0, 3.0])
    first = DiLoCo(model, InProcessGalaxy(1).averager(0, 3), hv, warn=lambda *_: None)
    _three_rounds(first, model, range(1, 2))
    saved_weights = model.weight.detach().clone()
    saved_state = copy.deepcopy(first.state_dict())
    resumed_model = linear_model(saved_weights[0].tolist())
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
        model = linear_model(start[0].tolist())
        hv = outer_hv(world_rank=rank, galaxy_size=2, local_steps=5, outer_lr=1.0, outer_momentum=0.0)
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
