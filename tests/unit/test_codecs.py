"""The pseudo-gradient codecs and their error feedback, on edge-case inputs and against hand-written
references (sparse rounds: test_sparse.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from open_diloco.config import HvConfig
from open_diloco.outer.codecs import CODECS, PseudoGradCompressor, build_compressor
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.encodings import BlockIntCodec, NonFiniteDelta, all_finite
from open_diloco.outer.state import OuterState
from open_diloco.outer.testing import InProcessGalaxy

NAMES = sorted(CODECS)


def _roundtrip(name: str, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codec = CODECS[name]()
    decoded = codec.decode(codec.encode(values))
    rounded = values.clone()
    codec.round_trip_(rounded)
    assert torch.equal(decoded, rounded), "round_trip_ differs from decode(encode())"
    return decoded, codec.encode(values)


@pytest.mark.parametrize("name", NAMES)
def test_zeros_decode_to_zeros_and_cost_a_header(name):
    decoded, blob = _roundtrip(name, torch.zeros(1000))
    assert torch.equal(decoded, torch.zeros(1000))
    if name != "bf16":
        assert blob.numel() == 12  # all-zero blocks are not sent


@pytest.mark.parametrize("name", NAMES)
def test_a_constant_block_is_exact_when_bf16_holds_it(name):
    decoded, _ = _roundtrip(name, torch.full((300,), -0.75))
    assert torch.equal(decoded, torch.full((300,), -0.75))
    decoded, _ = _roundtrip(name, torch.full((300,), 0.1))
    assert ((decoded - 0.1).abs() <= 0.1 * 2**-7).all()  # the scale is truncated to bf16


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("numel", [1, 7, 33, 129, 1000, 1_048_577])
def test_lengths_not_divisible_by_the_block(name, numel):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    decoded, _ = _roundtrip(name, values)
    assert decoded.shape == values.shape
    assert (
        float((decoded - values).norm() / values.norm())
        < {"bf16": 0.01, "int8": 0.02, "int4": 0.2, "int2": 0.6}[name]
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("magnitude", [3e38, 1e30, 1e-30, 1e-39])
def test_huge_and_tiny_values_stay_finite_and_close(name, magnitude):
    values = torch.tensor([1.0, -0.5, 0.25, -1.0] * 64) * magnitude
    decoded, _ = _roundtrip(name, values)
    assert torch.isfinite(decoded).all()
    scale = values.abs().max()
    tolerance = {"bf16": 2**-8, "int8": 2**-7, "int4": 0.1, "int2": 0.6}[name]
    if magnitude >= 1e-30:  # fp32 normals: relative to the block's scale
        assert ((decoded - values).abs() <= tolerance * scale).all()
    else:  # subnormals: only "no larger than the block"
        assert (decoded.abs() <= 2 * scale).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_not_encoded(name, bad):
    values = torch.randn(500)
    values[321] = bad
    codec = CODECS[name]()
    with pytest.raises(NonFiniteDelta, match="NaN or Inf"):
        codec.encode(values)
    with pytest.raises(NonFiniteDelta):
        codec.round_trip_(values.clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite_wherever_the_bad_value_sits(dtype):
    big = torch.finfo(dtype).max
    assert all_finite(torch.empty(0, dtype=dtype))
    assert all_finite(torch.zeros(5, dtype=dtype))
    assert all_finite(torch.tensor([big, -big, 0.0, -0.0], dtype=dtype))  # the range's ends are finite
    values = torch.randn(10_001, generator=torch.Generator().manual_seed(0)).to(dtype)
    for where in (0, 5_000, 10_000):
        for bad in (math.nan, math.inf, -math.inf):
            spoiled = values.clone()
            spoiled[where] = bad
            assert not all_finite(spoiled), (where, bad)
            assert all_finite(spoiled[:where]) == bool(torch.isfinite(spoiled[:where]).all())
    both = values.clone()
    both[[3, 7]] = torch.tensor([math.inf, -math.inf], dtype=dtype)  # min -inf and max +inf, no NaN
    assert not all_finite(both)
    assert all_finite(values)


@pytest.mark.parametrize("name", NAMES)
def test_rounded_values_encode_again_losslessly(name):
    """The outer loop rounds Δ before the round; the senders' wire encoding must not round it again."""
    codec = CODECS[name]()
    values = torch.randn(10_000) * torch.rand(10_000) ** 4
    codec.round_trip_(values)
    assert torch.equal(codec.decode(codec.encode(values, on_grid=True)), values)


def test_int8_matches_a_hand_written_quantizer():
    x = torch.tensor([0.5, -1.0, 0.25, 0.0])
    # scale = absmax 1.0 (bf16-exact); code = round(x·127.5 + 127.5); value = (code − 127.5)/127.5 · scale
    expected = torch.tensor([(191 - 127.5) / 127.5, -1.0, (159 - 127.5) / 127.5, (128 - 127.5) / 127.5])
    decoded, blob = _roundtrip("int8", x)
    assert torch.allclose(decoded, expected, rtol=0, atol=1e-7)
    assert blob.numel() == 12 + 2 + 256  # header, one bf16 scale, one block of codes


def test_int2_clips_to_one_and_a_half_rms():
    x = torch.zeros(128)
    x[0], x[1:] = 10.0, 0.1  # rms ≈ 0.89: the outlier clips to 1.5·rms, the rest are not drowned by it
    decoded, _ = _roundtrip("int2", x)
    rms = float(x.square().mean().sqrt())
    assert decoded[0] == pytest.approx(1.5 * rms, rel=2**-7)
    assert (decoded[1:] - 0.1).abs().max() < 0.5 * rms


def test_packing_sizes():
    for bits, block in ((8, 256), (4, 64), (2, 128)):
        blob = BlockIntCodec(bits, block).encode(torch.randn(4096))
        assert blob.numel() == 12 + 2 * 4096 // block + 4096 * bits // 8


# -- error feedback ------------------------------------------------------------------------------------------
def _hand_int8(x: torch.Tensor) -> torch.Tensor:
    """int8 blocks of 256 written out: scale = absmax truncated to bf16, 255 levels spanning ± scale."""
    out = torch.empty_like(x)
    for start in range(0, x.numel(), 256):
        block = x[start : start + 256]
        absmax = float(block.abs().max())
        scale = torch.tensor([absmax]).view(torch.int32).bitwise_and(-65536).view(torch.float32).item()
        for i, v in enumerate(block.tolist()):
            code = min(255, max(0, round(v * 127.5 / scale + 127.5))) if scale else 128
            out[start + i] = (code - 127.5) / 127.5 * scale
    return out


def test_error_feedback_matches_a_hand_computed_reference():
    """One cluster, int8, plain averaging: round k sends Q(Δ_k + e_{k−1}), keeps e_k = Δ_k + e_{k−1} − sent,
    and θ_outer moves by what was sent."""
    torch.manual_seed(0)
    start = torch.randn(300)
    model = torch.nn.Linear(300, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(start[None])
    hv = HvConfig(local_steps=1, outer_lr=1.0, outer_momentum=0.0, compression="int8")
    outer = DiLoCo(model, InProcessGalaxy(1, compression="int8").averager(0, 300), hv, warn=lambda *_: None)
    theta, error = start.clone(), torch.zeros(300)
    for round_no in range(3):
        local = theta + 0.01 * torch.randn(300)
        with torch.no_grad():
            model.weight.copy_(local[None])
        outer.after_inner_step(1)
        delta_fb = (theta - local) + error
        sent = _hand_int8(delta_fb)
        error = delta_fb - sent
        theta = theta - sent
        assert torch.allclose(outer.state.error, error, rtol=0, atol=1e-6), round_no
        assert torch.allclose(outer.state.params, theta, rtol=0, atol=1e-6), round_no
        assert float(error.abs().max()) > 0


def test_a_retried_round_sends_the_same_bytes_again():
    model = torch.nn.Linear(5000, 1, bias=False)
    state = OuterState(model, lr=1.0, momentum=0.0, compressor=build_compressor("int2", 0, "cyclic"))
    state.error.normal_()
    with torch.no_grad():
        model.weight.add_(0.1)
    first, again = torch.empty(5000), torch.empty(5000)
    state.pseudo_grad_for_wire_into(first)
    state.pseudo_grad_for_wire_into(again)
    assert torch.equal(first, again)


def test_error_feedback_keeps_what_the_wire_dropped_exactly():
    """After each round, e = Δ + e_old − sent, with sent read back from what was on the wire."""
    galaxy = InProcessGalaxy(1, compression="int2")
    model = torch.nn.Linear(9000, 1, bias=False)
    state = OuterState(model, lr=1.0, momentum=0.0, compressor=build_compressor("int2", 1 / 16, "random"))
    averager = galaxy.averager(0, 9000)
    for _round in range(3):
        with torch.no_grad():
            model.weight.add_(torch.randn(1, 9000) * 0.01)
        before = state.error.clone()
        delta = state.params - model.weight.detach().reshape(-1)
        state.pseudo_grad_for_wire_into(averager.values)
        sent = averager.values.clone()
        state.compressor.from_wire_(sent)  # a dense codec: what was sent is already dense
        state.apply(averager.values)
        assert torch.allclose(state.error, delta + before - sent, rtol=0, atol=1e-6)
        state.scatter_into_model()


def test_checkpoint_state_restores_the_error_feedback_bit_exact():
    model = torch.nn.Linear(70, 3, bias=True)
    state = OuterState(model, lr=1.0, momentum=0.0, compressor=build_compressor("int4", 0, "cyclic"))
    state.error.normal_()
    saved = copy.deepcopy(state.checkpoint_state(streaming=False))
    assert [p.shape for p in saved["error_feedback"].values()] == [p.shape for p in model.parameters()]
    fresh = OuterState(model, lr=1.0, momentum=0.0, compressor=build_compressor("int4", 0, "cyclic"))
    fresh.load_checkpoint_state(saved)
    assert torch.equal(fresh.error, state.error)


def test_a_late_joiner_or_resync_starts_with_zero_error_feedback():
    model = torch.nn.Linear(50, 1, bias=False)
    state = OuterState(model, lr=1.0, momentum=0.0, compressor=build_compressor("int8", 0, "cyclic"))
    state.error.normal_()
    state.adopt({"outer_step": 4}, [torch.zeros(50)])
    assert not state.error.any() and state.outer_step == 4


def test_no_error_feedback_keeps_no_buffer():
    model = torch.nn.Linear(50, 1, bias=False)
    state = OuterState(
        model, lr=1.0, momentum=0.0, compressor=build_compressor("int2", 0, "cyclic"), error_feedback=False
    )
    assert state.error is None and "error_feedback" not in state.checkpoint_state(streaming=False)
    assert build_compressor("none", 0, "cyclic") is None and build_compressor("fp16", 0, "cyclic") is None


def test_compressor_without_sparse_is_dense():
    assert PseudoGradCompressor(CODECS["int8"]()).sparse is None
