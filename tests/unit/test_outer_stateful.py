"""The outer loop as a ``Stateful``: what ``state_dict()`` gives is everything a resume needs, in the shape
DCP stores (pieces keyed and shaped like the parameters), and ``load_state_dict()`` puts it back bit for
bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

from open_diloco.config import HvConfig
from open_diloco.errors import ConfigError
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.loop import NullOuterLoop
from open_diloco.outer.stateful import PIECES
from open_diloco.outer.streaming import fragment_length
from open_diloco.outer.testing import InProcessGalaxy

# int2 keeps error feedback, and with fragments and a delay θ_outer and a round in flight; sparse keeps block
# scores instead of error feedback (a run never holds both): between them every piece of outer state
RUNS = {
    "int2-streaming": (dict(compression="int2", fragments=4, sync_delay=1), {*PIECES}),
    "sparse-magnitude": (dict(compression="sparse"), {"outer_momentum", "outer_params", "sparse_scores"}),
}


def _outer(seed: int, **settings) -> tuple[DiLoCo, torch.nn.Module, list[str]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 37))
    hv = HvConfig(local_steps=8, outer_momentum=0.9, **settings)
    numel = sum(p.numel() for p in model.parameters())
    galaxy = InProcessGalaxy(1, compression=hv.compression)
    warnings: list[str] = []
    outer = DiLoCo(model, galaxy.averager(0, fragment_length(numel, hv.fragments)), hv, warn=warnings.append)
    return outer, model, warnings


def _fill(outer: DiLoCo, model: torch.nn.Module, seed: int) -> None:
    """Random values in every buffer the run keeps, a round counter, and (with a sync delay) a round in flight
    that started from a θ_local other than θ_outer."""
    generator = torch.Generator().manual_seed(seed)
    state = outer.state
    state.params.copy_(torch.randn(state.numel, generator=generator))
    state.momentum_buffer = torch.randn(state.numel, generator=generator)
    if state.error is not None:
        state.error.copy_(torch.randn(state.numel, generator=generator))
    if state.sparse_scores is not None:
        state.sparse_scores.copy_(torch.rand(state.sparse_scores.shape, generator=generator))
    state.outer_step = 5 + seed
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator))
    if outer.hv.sync_delay:
        state.begin_round(state.outer_step % state.fragments, keep_local=True)


def _outer_state(outer: DiLoCo) -> dict:
    """What a resume must get back: the buffers, the round counter and the round in flight."""
    state = outer.state
    buffers = dict(
        params=state.params,
        momentum=state.momentum_buffer,
        error=state.error,
        scores=state.sparse_scores,
        local_at_start=state.local_at_start,
    )
    kept = {name: None if value is None else value.clone() for name, value in buffers.items()}
    return {**kept, "outer_step": state.outer_step, "fragment": state.fragment}


def _assert_bitwise_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[name] is not None and torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


@pytest.mark.parametrize("run", RUNS)
def test_outer_state_dict_round_trips_bit_exact(run):
    """Save, perturb every buffer, load: θ_outer, momentum, error feedback, block scores, the round in flight
    and the counters come back bit for bit, into the same loop and into a freshly built one (a resume)."""
    settings, pieces = RUNS[run]
    outer, model, _ = _outer(0, **settings)
    _fill(outer, model, seed=1)
    assert isinstance(outer, Stateful)
    saved = copy.deepcopy(outer.state_dict())
    assert set(saved) == {"outer_step", "fragments", "param_hash", "goodput"} | pieces
    for piece in pieces & set(PIECES):  # keyed and shaped like the parameters, so DCP can reshard them
        assert {name: p.shape for name, p in saved[piece].items()} == {
            name: p.shape for name, p in model.named_parameters()
        }
    expected, weights = _outer_state(outer), [p.detach().clone() for p in model.parameters()]

    _fill(outer, model, seed=2)
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights, strict=True):
            p.copy_(w)  # the checkpoint's model comes back first
    outer.load_state_dict(copy.deepcopy(saved))
    _assert_bitwise_equal(_outer_state(outer), expected)

    fresh, fresh_model, warnings = _outer(3, **settings)
    with torch.no_grad():
        for p, w in zip(fresh_model.parameters(), weights, strict=True):
            p.copy_(w)
    fresh.load_state_dict(saved)
    _assert_bitwise_equal(_outer_state(fresh), expected)
    assert warnings == []


def test_without_theta_outer_in_the_checkpoint_the_model_is_theta_outer():
    """A run whose model is θ_outer at every save stores no θ_outer: a load reads it from the loaded model."""
    outer, model, _ = _outer(0)
    saved = outer.state_dict()
    assert set(saved) == {
        "outer_step",
        "fragments",
        "param_hash",
        "goodput",
    }  # no momentum before a round with momentum
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    outer.load_state_dict(saved)
    assert torch.equal(outer.state.params, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def test_a_round_in_flight_of_other_fragments_is_refused():
    outer, model, _ = _outer(0, fragments=4, sync_delay=1)
    _fill(outer, model, seed=1)
    saved = outer.state_dict()
    other, _, _ = _outer(0, fragments=2, sync_delay=1)
    with pytest.raises(ConfigError, match="resume with --hv.fragments 4"):
        other.load_state_dict(saved)


def test_block_scores_missing_or_cut_for_another_shard_start_from_zero_with_a_warning():
    outer, model, _ = _outer(0, compression="sparse")
    _fill(outer, model, seed=1)
    saved = outer.state_dict()
    for scores in (None, torch.rand(2, 3)):
        fresh, _, warnings = _outer(0, compression="sparse")
        fresh.state.sparse_scores.fill_(1.0)
        fresh.load_state_dict(
            {**saved, "sparse_scores": scores}
            if scores is not None
            else {k: v for k, v in saved.items() if k != "sparse_scores"}
        )
        assert not fresh.state.sparse_scores.any()
        assert len(warnings) == 1 and "no sparse block scores" in warnings[0]


def test_no_galaxy_has_no_outer_state():
    null = NullOuterLoop()
    assert isinstance(null, Stateful) and null.state_dict() == {}
    null.load_state_dict({"outer_step": 3, "outer_momentum": {}})  # takes nothing, refuses nothing
    assert null.outer_step == 0
