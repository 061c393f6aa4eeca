"""Sparse rounds (``--hv.compression sparse``): which values a round sends, that what it does not send stays
in the model, and the ``magnitude`` rule's block scores shared by the galaxy; against hand-written
references."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch

from open_diloco.config import HvConfig
from open_diloco.outer.codecs import CODECS, build_compressor, score_values, wire_codecs
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.encodings import NonFiniteDelta, ScoreCodec
from open_diloco.outer.sparse import SparseSelection
from open_diloco.outer.state import OuterState
from open_diloco.outer.testing import InProcessGalaxy


# -- sparse selection ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["cyclic", "random"])
def test_sparse_selection_is_a_function_of_the_round_only(rule):
    selection = SparseSelection(1 / 16, rule)
    assert torch.equal(selection.columns(5), SparseSelection(1 / 16, rule).columns(5))
    assert not torch.equal(selection.columns(5), selection.columns(6))
    assert selection.columns(5).numel() == 256


def test_cyclic_selection_visits_every_value_once_per_period():
    selection = SparseSelection(1 / 16, "cyclic")
    seen = torch.cat([selection.columns(r) for r in range(16)])
    assert torch.equal(seen.sort().values, torch.arange(4096))


@pytest.mark.parametrize("numel", [4096 * 3, 4096 * 3 + 100, 77])
def test_gather_scatter_round_trip(numel):
    selection = SparseSelection(1 / 16, "random").select(numel, 3)
    flat = torch.arange(numel, dtype=torch.float32)
    compact = selection.gather(flat)
    assert compact.numel() == selection.numel == len(set(selection.index.tolist()))
    out = torch.zeros(numel)
    selection.scatter_(out, compact)
    assert torch.equal(out[out != 0], compact[compact != 0])
    assert int((out != 0).sum()) == int((compact != 0).sum())


def test_sparse_wire_form_is_packed_in_front_and_spread_back():
    compressor = build_compressor("sparse", 1 / 16, "cyclic")
    delta = torch.randn(4096 * 4 + 10)
    wire = delta.clone()
    selection = compressor.sparse.select(delta.numel(), 2)
    compressor.to_wire_(wire, None, selection)
    k = selection.numel
    assert (wire[k:] == 0).all() and (wire[:k] != 0).all()
    blob = compressor.codec.encode(wire, on_grid=True)
    assert blob.numel() < 4 * delta.numel() / 100  # >= 100x fewer bytes than fp32
    compressor.from_wire_(wire, selection)
    chosen = wire != 0
    assert int(chosen.sum()) == k
    assert float((wire[chosen] - delta[chosen]).norm() / delta[chosen].norm()) < 0.6


# -- sparse rounds: what a round does not send stays in the model --------------------------------------------
def _sparse_clusters(numel: int, rule: str, **hv) -> tuple[torch.Tensor, list, list[DiLoCo]]:
    """Two clusters of one ``Linear(numel)`` each, from the same random start, averaging in threads with the
    sparse codec and ``rule``: (the start, the models, their outer loops)."""
    galaxy = InProcessGalaxy(2, compression="sparse", sparse_rule=rule)
    start = torch.randn(numel)
    models, outers = [], []
    for rank in range(2):
        model = torch.nn.Linear(numel, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(start[None])
        config = HvConfig(
            galaxy_size=2, world_rank=rank, local_steps=1, compression="sparse", sparse_rule=rule, **hv
        )
        models.append(model)
        outers.append(DiLoCo(model, galaxy.averager(rank, numel), config, warn=lambda *_: None))
    return start, models, outers


def _round_in_threads(outers: list[DiLoCo]) -> None:
    threads = [threading.Thread(target=outer.after_inner_step, args=(1,)) for outer in outers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.mark.parametrize("error_feedback", [True, False])
def test_a_sparse_round_syncs_the_values_it_sent_and_keeps_the_rest_local(error_feedback):
    """Two clusters, plain averaging, two rounds written out by hand: θ_outer moves by the mean of the
    clusters' Q(Δ_sel) on the selected places only; on those places the model becomes θ_outer minus what the
    encoding dropped (with error feedback) or θ_outer itself (without); every other value keeps its local
    progress, so the next round's Δ there is everything since it was last sent. No error-feedback buffer is
    kept."""
    torch.manual_seed(0)
    numel = 3 * 4096 + 100
    start, models, outers = _sparse_clusters(
        numel, "random", sparse_density=1 / 16, error_feedback=error_feedback
    )
    assert all(outer.state.error is None for outer in outers)
    rule, codec = outers[0].state.compressor.sparse, CODECS["int2"]()
    theta = start.clone()
    for round_id in range(2):
        selection = rule.select(numel, round_id)
        locals_ = []
        for model in models:
            with torch.no_grad():
                model.weight.add_(0.01 * torch.randn(1, numel))
            locals_.append(model.weight.detach().reshape(-1).clone())
        sent, dropped = [], []
        for local in locals_:
            delta = selection.gather(theta - local)
            quantized = delta.clone()
            codec.round_trip_(quantized)
            sent.append(quantized)
            dropped.append(delta - quantized)
        wire = torch.zeros(numel)  # the reducer encodes the average once, in the wire's layout
        wire[: sent[0].numel()] = (sent[0] + sent[1]) / 2
        codec.round_trip_(wire)
        mean = wire[: sent[0].numel()]
        expected_theta = theta.clone()
        selection.scatter_(expected_theta, selection.gather(theta) - mean)
        _round_in_threads(outers)
        for outer, model, local, residual in zip(outers, models, locals_, dropped, strict=True):
            assert torch.allclose(outer.state.params, expected_theta, rtol=0, atol=1e-6), round_id
            expected_model = local.clone()
            synced = selection.gather(expected_theta) - (residual if error_feedback else 0)
            selection.scatter_(expected_model, synced)
            assert torch.allclose(model.weight.detach().reshape(-1), expected_model, rtol=0, atol=1e-6), (
                round_id
            )
        assert torch.equal(outers[0].state.params, outers[1].state.params)
        theta = expected_theta
    unsent = torch.ones(numel, dtype=torch.bool)
    for round_id in range(2):
        selection = rule.select(numel, round_id)
        selection.scatter_(unsent, torch.zeros(selection.numel, dtype=torch.bool))
    assert torch.equal(outers[0].state.params[unsent], start[unsent])  # never sent: θ_outer untouched there


def test_a_sparse_run_checkpoints_theta_outer_beside_the_model():
    """The model is not θ_outer after a sparse round, so a checkpoint stores θ_outer too, and a resync or a
    late join puts θ_outer into the whole model (the unsent local progress belonged to the trajectory it
    leaves)."""
    model = torch.nn.Linear(5000, 1, bias=False)
    hv = HvConfig(local_steps=1, compression="sparse")
    outer = DiLoCo(
        model, InProcessGalaxy(1, compression="sparse").averager(0, 5000), hv, warn=lambda *_: None
    )
    with torch.no_grad():
        model.weight.add_(0.1)
    outer.after_inner_step(1)
    assert not torch.equal(model.weight.detach().reshape(-1), outer.state.params)
    assert torch.equal(outer.state_dict()["outer_params"]["weight"].reshape(-1), outer.state.params)
    outer.state.adopt({"outer_step": 7}, [outer.state.params.clone()])
    assert torch.equal(model.weight.detach().reshape(-1), outer.state.params)


# -- the magnitude rule: blocks picked by the galaxy's shared scores -----------------------------------------
def test_score_codec_keeps_powers_of_two_in_one_byte():
    codec = ScoreCodec()
    values = torch.tensor([0.0, 1.0, 0.75, 3.9e-3, 2.0**-126, 1e-45, 6e37])
    blob = codec.encode(values)
    assert blob.numel() == 12 + values.numel()  # the header, then one byte a value
    decoded = codec.decode(blob)
    assert decoded.tolist() == [
        0.0,
        1.0,
        0.5,
        2.0**-9,
        2.0**-126,
        0.0,
        2.0**125,
    ]  # truncated to a power of two
    again = values.clone()
    codec.round_trip_(again)
    assert torch.equal(again, decoded) and torch.equal(codec.decode(codec.encode(decoded)), decoded)
    with pytest.raises(NonFiniteDelta):
        codec.encode(torch.tensor([1.0, float("inf")]))


def test_wire_codecs_decode_by_the_tag_in_the_header():
    codecs = wire_codecs("sparse", "magnitude")
    values, scores = torch.randn(300), torch.tensor([0.5, 0.25])
    assert torch.equal(codecs.decode(codecs.for_key(1).encode(scores)), scores)
    int2 = codecs.for_key(0)
    assert torch.equal(codecs.decode(int2.encode(values)), int2.decode(int2.encode(values)))
    assert len(wire_codecs("sparse", "random").codecs) == 1  # no scores
    assert score_values(1000, "sparse", "magnitude") == 8 and score_values(1000, "sparse", "random") == 0
    assert score_values(1000, "int2", "magnitude") == 0


def test_magnitude_selection_takes_the_top_scored_whole_blocks():
    rule = SparseSelection(0.25, "magnitude")
    numel = 7 * 128 + 50  # 8 blocks, the last one short: 2 of them are sent
    scores = torch.tensor([2.0**-20, 2.0**-3, 0.0, 2.0**-3, 2.0**-1, 2.0**-8, 2.0**-30, 2.0**-2])
    chosen = rule.select(numel, 5, scores)
    assert chosen.blocks.tolist() == [4, 7]  # the two highest codes; the short block's index stops at numel
    assert chosen.index.tolist() == list(range(4 * 128, 5 * 128)) + list(range(7 * 128, numel))
    ties = rule.select(numel, 5, torch.full((8,), 2.0**-3)).blocks  # level: the round's seeded permutation
    assert ties.numel() == 2 and torch.equal(ties, rule.select(numel, 5, torch.full((8,), 2.0**-3)).blocks)
    first_rounds = {tuple(rule.select(numel, r, torch.zeros(8)).blocks.tolist()) for r in range(20)}
    assert len(first_rounds) > 5  # zero scores (before any round): a fresh random pick per round id


def test_unsent_scores_are_mean_squares_of_what_stays_behind():
    rule = SparseSelection(0.5, "magnitude")
    dense = torch.cat([torch.full((128,), 0.5), torch.full((128,), 2.0), torch.full((10,), 3.0)])
    chosen = rule.select(dense.numel(), 0, torch.tensor([0.0, 1.0, 1.0]))  # 2 of 3 blocks: 1 and 2
    assert chosen.blocks.tolist() == [1, 2]
    dropped = torch.cat([torch.full((128,), 0.25), torch.full((10,), -0.125)])
    scores = rule.unsent_scores(dense, chosen, dropped)
    assert scores.tolist() == [
        0.25,
        0.0625,
        2.0**-6,
    ]  # 0.5², 0.25², 0.125² (the short block: over its 10 values)


def test_magnitude_rounds_share_the_scores_and_follow_them():
    """Two clusters, plain averaging: after a round both hold the same block scores, each the power of two of
    the clusters' mean of what they left unsent there, written out by hand; the next round sends the blocks
    with the top codes; a late joiner's snapshot and the hash carry the scores."""
    torch.manual_seed(1)
    numel, density = 20 * 128 + 30, 0.2
    _start, models, outers = _sparse_clusters(
        numel, "magnitude", sparse_density=density, outer_lr=1.0, outer_momentum=0.0
    )
    rule, int2, score = outers[0].state.compressor.sparse, CODECS["int2"](), ScoreCodec()
    assert outers[0].state.sparse_scores.shape == (1, 21)
    for round_id in range(3):
        chosen = rule.select(numel, round_id, outers[0].state.sparse_scores[0].clone())
        own_scores = []
        for rank, model in enumerate(models):
            with torch.no_grad():
                model.weight.add_(torch.randn(1, numel) * torch.linspace(0.001, 0.1 * (rank + 1), numel))
            delta = outers[rank].state.params - model.weight.detach().reshape(-1)
            sent = chosen.gather(delta)
            int2.round_trip_(sent)
            own = rule.unsent_scores(delta, chosen, chosen.gather(delta) - sent)
            assert torch.equal(
                own, own.clone().apply_(lambda v: 2.0 ** math.floor(math.log2(v)) if v else 0.0)
            )
            own_scores.append(own)
        expected = (own_scores[0] + own_scores[1]) / 2
        score.round_trip_(expected)
        _round_in_threads(outers)
        assert torch.equal(outers[0].state.sparse_scores[0], expected), round_id
        assert torch.equal(outers[1].state.sparse_scores[0], expected), round_id
        assert torch.equal(outers[0].state.params, outers[1].state.params)
        following = rule.select(numel, round_id + 1, expected).blocks
        codes = ScoreCodec.exponents(expected)
        assert int(codes[following].min()) >= int(codes[~torch.isin(torch.arange(21), following)].max()), (
            round_id
        )
    state = outers[0].state
    metadata, tensors = state.snapshot()
    assert metadata["sparse_scores"] and torch.equal(tensors[-1], state.sparse_scores)
    joiner = OuterState(
        models[1], lr=1.0, momentum=0.0, compressor=build_compressor("sparse", density, "magnitude")
    )
    joiner.adopt(metadata, tensors)
    assert torch.equal(joiner.sparse_scores, state.sparse_scores) and joiner.hash() == state.hash()
    hash_before = state.hash()
    saved = copy.deepcopy(
        state.checkpoint_state(streaming=False)
    )  # θ_outer too: a sparse run's model is not it
    state.load_checkpoint_state(
        {**saved, "sparse_scores": torch.zeros(2, 21)}
    )  # cut for another shard: zeroed
    assert not state.sparse_scores_fit(torch.zeros(2, 21)) and not state.sparse_scores.any()
    assert state.hash() != hash_before  # the scores are part of the shared state the hash proves
    state.load_checkpoint_state(saved)
    assert state.hash() == hash_before
