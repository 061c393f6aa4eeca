"""DiLoCo when training or a round goes wrong: a diverged cluster sends nothing and adopts the galaxy's state,
a non-finite pseudo-gradient or average is never encoded nor applied, and a cluster that keeps failing stops
with one line. In-process averager (no hivemind)."""

from __future__ import annotations

import contextlib
import re
import threading

import pytest
import torch

from open_diloco.errors import GalaxyError, RoundFailed
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.testing import InProcessAverager, InProcessGalaxy
from tests.support.tiny_outer import linear_model, outer_hv


def test_a_diverged_cluster_sends_nothing_and_adopts_the_galaxy_state():
    # clusters 0 and 1 average; cluster 2's training diverged (NaN weights): it must not send (one NaN Δ makes
    # every cluster's θ_outer NaN), and heals by adopting the galaxy's θ_outer once their round is applied
    galaxy = InProcessGalaxy(2, serve_state=True)
    hv = dict(galaxy_size=3, outer_lr=1.0, outer_momentum=0.0, on_partial_round="proceed", join_timeout=10.0)
    warnings: list[str] = []
    model = linear_model([1.0])
    diverged = DiLoCo(model, galaxy.averager(2, 1), outer_hv(world_rank=2, **hv), warn=warnings.append)
    results = {}

    def healthy(rank: int, local: float):
        healthy_model = linear_model([1.0])
        outer = DiLoCo(
            healthy_model, galaxy.averager(rank, 1), outer_hv(world_rank=rank, **hv), warn=lambda *_: None
        )
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
    # from either healthy cluster: both hold the round (the first to apply it may be the only source yet)
    assert "pseudo-gradient is not finite" in warnings[0]
    assert re.search(r"adopted cluster [01]'s state at outer step 1", warnings[1]), warnings[1]


def test_a_cluster_that_keeps_diverging_stops_with_one_line():
    model = linear_model([1.0])
    outer = DiLoCo(model, InProcessGalaxy(1).averager(0, 1), outer_hv(max_bad_rounds=2), warn=lambda *_: None)
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
    model = linear_model([1.0, 2.0, 3.0, 4.0])
    hv = outer_hv(compression="int8", outer_lr=1.0, outer_momentum=0.0)
    outer = DiLoCo(model, InProcessGalaxy(1, compression="int8").averager(0, 4), hv, warn=lambda *_: None)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, float("nan"), 3.0, 4.0]]))
    assert outer.after_inner_step(1)["pseudo_grad_finite"] is False
    assert torch.equal(outer.state.error, torch.zeros(4))
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[1.0, 2.0, 3.0, 4.0]]))


def test_a_good_round_resets_the_count_of_diverged_rounds():
    model = linear_model([1.0])
    outer = DiLoCo(model, InProcessGalaxy(1).averager(0, 1), outer_hv(max_bad_rounds=1), warn=lambda *_: None)
    for local in (float("nan"), 0.5, float("nan"), 0.25):
        with torch.no_grad():
            model.weight.fill_(local)
        outer.after_inner_step(1)  # never two bad rounds in a row: never stops


def test_a_non_finite_average_is_never_applied():
    class GarbageAverage(InProcessAverager):  # a peer reduced our span into NaN
        def start_round(self, round_id, fingerprint, attempt=0, plan=None):
            pending = super().start_round(round_id, fingerprint, attempt, plan)
            wait = pending.wait

            def poisoned():
                report = wait()
                self.values.fill_(float("nan"))
                return report

            pending.wait = poisoned
            return pending

    galaxy = InProcessGalaxy(1)
    warnings: list[str] = []
    model = linear_model([1.0])
    outer = DiLoCo(
        model, GarbageAverage(galaxy, 0, 1), outer_hv(outer_lr=1.0, outer_momentum=0.0), warn=warnings.append
    )
    with torch.no_grad():
        model.weight.fill_(0.5)
    record = outer.after_inner_step(1)
    assert record["average_finite"] is False and "not applied" in warnings[0]
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.5]]))  # its own Δ, never NaN


def test_a_round_still_holding_the_buffer_stops_with_one_line():
    # The round's result never came and hivemind still holds the buffer past its timeout: nothing can be
    # applied.
    class StuckAfterStart(InProcessAverager):
        @contextlib.contextmanager
        def buffer(self):
            if self.calls:
                raise RoundFailed("the averager is still busy with a previous round")
            yield self.values

    outer = DiLoCo(
        linear_model([1.0]), StuckAfterStart(InProcessGalaxy(1), 0, 1), outer_hv(), warn=lambda *_: None
    )
    with pytest.raises(
        GalaxyError, match=r"^outer step 1: the averager is still busy .*resume from the last"
    ):
        outer.after_inner_step(1)
