"""Streaming DiLoCo (``--hv.fragments`` P, ``--hv.sync-delay`` τ) against hand-written references, with the
in-process galaxy (no hivemind): the schedule, the per-fragment outer step, the local progress kept across a
delayed landing, and a resume with a round in flight."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from open_diloco.config import HvConfig
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.optimizer import outer_sgd_step_
from open_diloco.outer.streaming import SyncSchedule, fragment_length
from open_diloco.outer.testing import InProcessGalaxy

SILENT = dict(warn=lambda *_: None)


def _models(size: int) -> list[torch.nn.Module]:
    """Identical small two-layer models (93 + 1813 values: fragments cut across parameters)."""
    models = []
    for _ in range(size):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 37)))
    return models


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _inner_step(model: torch.nn.Module, generator: torch.Generator) -> None:
    """A stand-in for AdamW: a deterministic, cluster-specific move of every weight."""
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.01 * torch.randn(p.shape, generator=generator))


def _run(size: int, steps: int, compression: str = "none", models=None, on_step=None, **hv) -> dict:
    """``size`` clusters in threads, ``steps`` inner steps each; returns each cluster's records and outer
    loop."""
    galaxy = InProcessGalaxy(
        size, compression=compression, sparse_rule=hv.get("sparse_rule", HvConfig().sparse_rule)
    )
    models = models or _models(size)
    results: dict[int, tuple] = {}
    settings = dict(local_steps=4, outer_lr=0.7, outer_momentum=0.9, outer_warmup_rounds=2)

    def cluster(rank: int) -> None:
        model = models[rank]
        config = HvConfig(
            **{**settings, **hv, "galaxy_size": size, "world_rank": rank, "compression": compression}
        )
        numel = fragment_length(_flat(model).numel(), config.fragments)
        outer = DiLoCo(model, galaxy.averager(rank, numel), config, **SILENT)
        generator = torch.Generator().manual_seed(100 + rank)
        records = []
        for step in range(1, steps + 1):
            _inner_step(model, generator)
            before = _flat(model).clone() if on_step is not None else None
            syncs = outer.syncs_after_inner_step(step, last=step == steps)
            if on_step is not None:
                on_step(rank, step, before, outer, syncs, _flat(model).clone())
            records.extend({**record.metrics(), "step": step} for record in syncs)
        results[rank] = (records, outer, model)

    threads = [threading.Thread(target=cluster, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == size, "a cluster did not finish"
    return results


# Recorded with the code before fragments existed (commit dbc3025): 2 clusters, H = 4, six rounds, lr 0.7,
# Nesterov 0.9, two warm-up rounds. P = 1, τ = 0 must keep reproducing them bit for bit.
TODAYS_HASHES = {
    "none": [
        "f6f934d5a22f8dcd",
        "61e8d036641caff6",
        "53758755dfbbebf4",
        "43c431cc2370c426",
        "9eabc8af7b78a2a9",
        "72019a99acc0e086",
    ],
    "int8": [
        "549f1168aec5b0e6",
        "1b471cf15139fd03",
        "fb47be2750627ef5",
        "99036fced896035b",
        "fa95a4f2ff8323c3",
        "78d7ef84129385d8",
    ],
    "sparse": [
        "c0d0b1e79ca65f03",
        "aac46248af68bccf",
        "a40672b23ad8708a",
        "d0883ff7fb61c2c9",
        "bbd5bd789474648b",
        "a41aed203f4b7c68",
    ],
}


@pytest.mark.parametrize("compression", sorted(TODAYS_HASHES))
def test_one_fragment_without_delay_is_plain_diloco_bit_for_bit(compression):
    # the sparse rule and density when recorded
    results = _run(2, 24, compression, fragments=1, sync_delay=0, sparse_rule="cyclic", sparse_density=0.0625)
    for rank in (0, 1):
        records = results[rank][0]
        assert [r["param_hash"] for r in records] == TODAYS_HASHES[compression]
        assert [r["step"] for r in records] == [4, 8, 12, 16, 20, 24]
        assert all(r["fragment"] == 0 for r in records)


def test_schedule():
    schedule = SyncSchedule(local_steps=8, fragments=4, sync_delay=1)
    assert [t for t in range(1, 17) if schedule.starts_sync(t)] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [schedule.fragment_of(k) for k in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [schedule.fragment_round(k) for k in range(6)] == [1, 1, 1, 1, 2, 2]
    assert schedule.inner_step_of(5) == 10 and schedule.streaming
    assert not SyncSchedule(local_steps=8).streaming
    assert fragment_length(10, 4) == 3 and fragment_length(12, 4) == 3


@pytest.mark.parametrize("delay", [1, 2])  # 2 = H/P: a sync lands at the step the next one starts
def test_fragments_with_delay_match_a_per_fragment_reference(delay):
    """P = 4, H = 8: fragment f's θ_outer follows its own Nesterov outer optimizer over its own rounds,
    fed the mean of the clusters' Δ taken when its round started; the other fragments are untouched by its
    round; every cluster holds the same θ_outer bytes; the fragment lands as α·θ_local + (1 −
    α)·θ_outer_new."""
    size, fragments, steps = 2, 4, 8 * 3
    models = _models(size)
    numel = _flat(models[0]).numel()
    length = fragment_length(numel, fragments)
    starts: dict[int, dict[int, torch.Tensor]] = {0: {}, 1: {}}
    """θ_local when each sync started (after the inner step of its start, before any landing)"""
    landed: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {0: {}, 1: {}}
    """per landing step: θ_local before it, θ_outer after it, θ_local after it"""

    def on_step(rank, step, before, outer, syncs, after):
        if step % 2 == 0:  # (at τ = 2 the landing before the start touches another fragment: `before` serves)
            starts[rank][step] = before
        if syncs:
            landed[rank][step] = (before, outer.state.params.clone(), after)

    results = _run(
        size, steps, models=models, on_step=on_step, local_steps=8, fragments=fragments, sync_delay=delay
    )
    records = [results[rank][0] for rank in range(size)]
    assert [r["fragment"] for r in records[0]] == [k % fragments for k in range(steps // 2)]
    assert [r["step"] for r in records[0]] == [min(k * 2 + delay, steps) for k in range(1, steps // 2)] + [
        steps
    ]
    # each record names the step its sync started after (what ``open-diloco audit-data`` reads)
    assert [r["sync_step"] for r in records[0]] == [k * 2 for k in range(1, steps // 2 + 1)]
    for a, b in zip(*records, strict=True):
        assert a["param_hash"] == b["param_hash"] and a["fragment_hash"] == b["fragment_hash"]
        assert a["in_sync"] and b["in_sync"]

    # the reference: per fragment, torch-style SGD with the outer warm-up over the fragment's own rounds
    theta = _flat(_models(1)[0]).clone()
    momenta: dict[int, torch.Tensor | None] = dict.fromkeys(range(fragments))
    for k, record in enumerate(records[0]):
        fragment, sync_step = k % fragments, (k + 1) * 2
        region = slice(fragment * length, min((fragment + 1) * length, numel))
        mean_delta = torch.stack(
            [theta[region] - starts[rank][sync_step][region] for rank in range(size)]
        ).mean(0)
        lr, momentum = results[0][1].state.hparams(k // fragments + 1)
        if momentum and momenta[fragment] is None:
            momenta[fragment] = torch.zeros_like(mean_delta)
        grad = mean_delta.clone()
        outer_sgd_step_(theta[region], grad, momenta[fragment], lr=lr, momentum=momentum, nesterov=True)
        if k + 1 < len(records[0]) and records[0][k + 1]["step"] == record["step"]:
            # τ = H/P at the run's end: the last sync ran at the step this one landed; checked after it
            continue
        model_before, params, model_after = landed[0][record["step"]]
        assert torch.allclose(params, theta, atol=1e-6, rtol=0), (
            f"sync {k + 1}: θ_outer differs from the reference"
        )
        theta = params.clone()  # carry the exact bytes on, so float rounding never accumulates across rounds
        if record["step"] != steps:  # the last sync lands at once: no progress to keep
            mixed = 0.5 * model_before[region] + 0.5 * params[region]  # --hv.sync-alpha 0.5
            assert torch.allclose(model_after[region], mixed, atol=1e-6, rtol=0)
        outside = torch.ones(numel, dtype=torch.bool)
        outside[region] = False
        # the sync that landed just before it, same step
        if k and records[0][k - 1]["step"] == record["step"]:
            previous = (k - 1) % fragments
            outside[previous * length : (previous + 1) * length] = False
        assert torch.equal(model_after[outside], model_before[outside]), "a landing touched another fragment"


def _checkpoint(outer: DiLoCo, model: torch.nn.Module) -> dict:
    """What ``checkpoint.py`` stores of a cluster, as plain copies (DCP's part is tested in tests/dist)."""
    return {
        "model": [p.detach().clone() for p in model.parameters()],
        "outer": copy.deepcopy(outer.state_dict()),
    }


# int2: the error feedback of the fragment in flight; τ = 2 = H/P: sync 4 landed at the step of the save
@pytest.mark.parametrize(("compression", "delay"), [("none", 1), ("int2", 1), ("none", 2)])
def test_resume_with_a_round_in_flight_is_bit_exact(compression, delay):
    """A checkpoint taken while a fragment's round is in flight records it (θ_outer and the fragment's θ_local
    at the round's start); the resumed galaxy sends that round again and ends bitwise where the straight run
    does."""
    size, steps, saved_at = 2, 24, 10  # H = 8, P = 4: sync 5 (fragment 0) starts at step 10
    hv = dict(local_steps=8, fragments=4, sync_delay=delay, outer_momentum=0.9, outer_warmup_rounds=2)
    straight = _run(size, steps, compression, **hv)
    models = _models(size)
    saved: dict[int, dict] = {}
    generators: dict[int, torch.Tensor] = {}

    def phase(galaxy, rank, model, first: int, last: int, restore: dict | None):
        config = HvConfig(
            **{
                **dict(outer_lr=0.7),
                **hv,
                "galaxy_size": size,
                "world_rank": rank,
                "compression": compression,
            }
        )
        outer = DiLoCo(
            model, galaxy.averager(rank, fragment_length(_flat(model).numel(), 4)), config, **SILENT
        )
        generator = torch.Generator().manual_seed(100 + rank)
        if restore is not None:
            with torch.no_grad():
                for p, value in zip(model.parameters(), restore["model"], strict=True):
                    p.copy_(value)
            outer.load_state_dict(restore["outer"])
            generator.set_state(generators[rank])
            assert outer.join_galaxy() <= first - 1 and outer.in_flight is not None
        records = []
        for step in range(first, last + 1):
            _inner_step(model, generator)
            records.extend(
                {**record.metrics(), "step": step}
                for record in outer.syncs_after_inner_step(step, step == steps)
            )
        if restore is None:
            assert outer.in_flight is not None and outer.state.fragment == 0
            saved[rank], generators[rank] = _checkpoint(outer, model), generator.get_state()
        return records

    def run_phase(first, last, restore):
        galaxy, out = InProcessGalaxy(size, compression=compression), {}

        def cluster(rank):
            model = models[rank] if restore is None else _models(1)[0]
            out[rank] = phase(galaxy, rank, model, first, last, None if restore is None else restore[rank])

        threads = [threading.Thread(target=cluster, args=(rank,)) for rank in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(out) == size
        return out

    run_phase(1, saved_at, None)
    assert {"outer_params", "sync_start"} <= set(saved[0]["outer"])
    resumed = run_phase(saved_at + 1, steps, saved)
    for rank in range(size):
        expected = [r for r in straight[rank][0] if r["step"] > saved_at]
        assert [r["step"] for r in resumed[rank]] == [r["step"] for r in expected]
        assert [r["param_hash"] for r in resumed[rank]] == [r["param_hash"] for r in expected]
        assert resumed[rank][0]["outer_step"] == 5 and resumed[rank][0]["fragment"] == 0
        # the round sent again is the one the straight run sent: its ledger entry (members with their inner
        # steps) too
        assert [r.get("ledger") for r in resumed[rank]] == [r.get("ledger") for r in expected]
        assert resumed[rank][0]["ledger"]["members"][0]["inner_steps"] == 8
