"""The codecs a round's tensors travel in: each :class:`Codec` turns one contiguous run of fp32 values into
bytes and back (``encode``/``decode``), and rounds values in place to exactly what a decode of their encoding
gives (``round_trip_``, no packing); :class:`WireCodecs` picks the codec of each tensor of a round's buffer.
Pure torch, no hivemind. What the outer loop does with them around a round is ``outer/codecs.py``.

Integer codecs (int8/int4/int2) quantize blocks of ``block`` values on a uniform grid of 2^bits levels
spanning ± the block's scale, kept in bf16 (2 bytes per block). The scale is the block's absmax, or for int2
the smaller of the absmax and 1.5 x the block's RMS (values past it clip to the outer level; the error
feedback carries the rest), truncated to bf16 (never above the absmax). The outer level decodes to exactly the
scale, so values already on a grid encode again to the very same bytes with the absmax rule (``on_grid``): the
outer loop rounds Δ before the round, the senders' wire encoding is lossless, and the error feedback the outer
loop computed is exactly what the wire dropped. Block sizes and the int2 clip were chosen by measurement on
real pseudo-gradients (docs/results/compression.md): absmax beat a ±kσ range at 8 and 4 bits; at 2 bits the
1.5σ clip cut the error.

Blocks are counted from the start of the flat shard buffer; the all-reduce cuts its parts at multiples of
``block`` (the part size is a power of two, see ``galaxy/allreduce.py``), so a part's blocks are the buffer's.
"""

from __future__ import annotations

import torch

from open_diloco.errors import OpenDilocoError

_HEADER_WORDS = 3  # int32: codec tag, numel, blocks carried
_HEADER_BYTES = 4 * _HEADER_WORDS
CHUNK = 1 << 20  # values per round_trip_ slice: bounds temporaries; a multiple of every block size
_FP32_MAX = torch.finfo(torch.float32).max
_BF16_MAX = torch.finfo(torch.bfloat16).max


class NonFiniteDelta(OpenDilocoError):
    """A pseudo-gradient holds NaN or Inf: it is refused, not encoded (the run diverged)."""


def all_finite(values: torch.Tensor) -> bool:
    """Whether ``values`` holds no NaN and no ±Inf, many times faster than ``torch.isfinite(values).all()`` on
    CPU (no full-size boolean tensor): the smallest and largest value are finite iff every value is (both are
    NaN as soon as one value is). Every round checks each part it reduces and the average it applies, inside
    the time a streaming sync has to hide in (docs/overlap.md)."""
    if values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _check_finite(finite: bool, what: str) -> None:
    if not finite:
        raise NonFiniteDelta(
            f"{what} holds NaN or Inf values: refusing to encode it (training diverged: lower --lr or resume "
            "from an earlier checkpoint)"
        )


def _header(tag: int, numel: int, carried: int) -> torch.Tensor:
    return torch.tensor([tag, numel, carried], dtype=torch.int32).view(torch.uint8)


def _read_header(blob: torch.Tensor, tag: int, name: str) -> tuple[int, int]:
    if blob.dtype != torch.uint8 or blob.numel() < _HEADER_BYTES:
        raise ValueError(f"not a {name} encoding: {blob.numel()} {blob.dtype} values")
    found, numel, carried = blob[:_HEADER_BYTES].clone().view(torch.int32).tolist()
    if found != tag:
        raise ValueError(f"not a {name} encoding (tag {found}, expected {tag})")
    return numel, carried


class Codec:
    """One encoding of a flat fp32 run. ``wire_ratio`` (bytes sent per fp32 byte, nominal) sizes the
    all-reduce's parts: a power of two, so parts start on block boundaries."""

    name: str
    block: int
    wire_ratio: float

    def encode(self, values: torch.Tensor, on_grid: bool = False) -> torch.Tensor:
        """The uint8 encoding of ``values`` (1-D fp32); raises :class:`NonFiniteDelta` on NaN/Inf."""
        raise NotImplementedError

    def decode(self, blob: torch.Tensor) -> torch.Tensor:
        """The fp32 values an :meth:`encode` output stands for."""
        raise NotImplementedError

    def round_trip_(self, values: torch.Tensor) -> None:
        """``values ← decode(encode(values))`` in place, bit for bit, without building the bytes."""
        raise NotImplementedError


class Bf16Codec(Codec):
    """bf16, round to nearest even: fp32's range, 8 bits of mantissa; 2x smaller than fp32 (values beyond
    bf16's largest finite value are clamped to it)."""

    name, block, wire_ratio = "bf16", 1, 0.5
    _TAG = 0x0BF16

    def _to_bf16(self, values: torch.Tensor) -> torch.Tensor:
        _check_finite(all_finite(values), "the pseudo-gradient")
        return values.clamp(-_BF16_MAX, _BF16_MAX).to(torch.bfloat16)

    def encode(self, values: torch.Tensor, on_grid: bool = False) -> torch.Tensor:
        payload = self._to_bf16(values.reshape(-1)).view(torch.uint8)
        return torch.cat([_header(self._TAG, values.numel(), values.numel()), payload])

    def decode(self, blob: torch.Tensor) -> torch.Tensor:
        numel, _ = _read_header(blob, self._TAG, self.name)
        payload = blob[_HEADER_BYTES:]
        if payload.numel() != 2 * numel:
            raise ValueError(f"bf16 encoding of {numel} values has {payload.numel()} payload bytes")
        return payload.clone().view(torch.bfloat16).float()

    def round_trip_(self, values: torch.Tensor) -> None:
        for piece in values.view(-1).split(CHUNK):
            piece.copy_(self._to_bf16(piece))


class BlockIntCodec(Codec):
    """``bits``-bit uniform quantization per block of ``block`` values, scaled by the block's absmax (see the
    module docstring). Trailing all-zero blocks are not sent (a sparse Δ's empty tail costs 12 bytes)."""

    def __init__(self, bits: int, block: int, clip_sigmas: float | None = None):
        if bits not in (2, 4, 8) or block % 8 or block < 8:
            raise ValueError(
                f"BlockIntCodec(bits={bits}, block={block}): bits is 2, 4 or 8; block a multiple of 8"
            )
        self.bits, self.block, self.clip_sigmas = bits, block, clip_sigmas
        self.name = f"int{bits}"
        self.wire_ratio = bits / 32
        self.levels = 1 << bits
        self.half = (self.levels - 1) / 2
        # code c decodes to unit[c]·scale; unit[top] is exactly 1, so the outer level is the scale itself
        self.unit = (torch.arange(self.levels, dtype=torch.float32) - self.half) / self.half
        self._tag = 0x1A0 + bits
        self._per_byte = 8 // bits
        self._shifts = torch.arange(self._per_byte, dtype=torch.uint8) * bits

    # -- the math, shared by every path ----------------------------------------------------------------------
    def _blocks(self, values: torch.Tensor) -> torch.Tensor:
        flat = values.reshape(-1)
        pad = -flat.numel() % self.block
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.block)

    def _scales(self, blocks: torch.Tensor, numel: int, on_grid: bool = False) -> torch.Tensor:
        absmax = blocks.abs().amax(1)
        _check_finite(all_finite(absmax), "the pseudo-gradient")
        if self.clip_sigmas is not None and not on_grid:
            counts = torch.full_like(absmax, self.block)
            if numel % self.block:  # the padding of the last block is not part of its RMS
                counts[-1] = numel % self.block
            clip = blocks.square().sum(1).div_(counts).sqrt_().mul_(self.clip_sigmas)
            # below ~1e-19 the squares underflow to 0 (and past ~1e19 overflow): such blocks keep their absmax
            absmax = torch.where(clip > 0, torch.minimum(absmax, clip), absmax)
        # truncate to bf16 (clear the low 16 bits): never above the absmax, exactly representable
        return (absmax.view(torch.int32) & -65536).view(torch.float32)

    def _codes(self, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        inverse = torch.where(scales > 0, self.half / scales, 0.0).clamp_(max=_FP32_MAX)
        codes = torch.addcmul(torch.full_like(blocks, self.half), blocks, inverse[:, None])
        return codes.round_().clamp_(0, self.levels - 1).to(torch.uint8)

    def _values(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return self.unit[codes.long()].view(-1, self.block).mul_(scales[:, None])

    # -- the three entry points ------------------------------------------------------------------------------
    def round_trip_(self, values: torch.Tensor) -> None:
        flat = values.view(-1)
        for piece in flat.split(CHUNK):
            blocks = self._blocks(piece)
            scales = self._scales(blocks, piece.numel())
            piece.copy_(self._values(self._codes(blocks, scales), scales).view(-1)[: piece.numel()])

    def encode(self, values: torch.Tensor, on_grid: bool = False) -> torch.Tensor:
        """``on_grid``: ``values`` came out of :meth:`round_trip_`; scale by the absmax, which re-encodes them
        exactly."""
        numel = values.numel()
        blocks = self._blocks(values)
        scales = self._scales(blocks, numel, on_grid)
        nonzero = torch.nonzero(scales).view(-1)
        carried = int(nonzero[-1]) + 1 if nonzero.numel() else 0
        blocks, scales = blocks[:carried], scales[:carried]
        codes = self._codes(blocks, scales).view(-1, self._per_byte)
        packed = codes[:, 0].clone()
        for slot in range(1, self._per_byte):  # at most 4 bit positions, each a vector op over all bytes
            packed |= codes[:, slot] << self._shifts[slot]
        bf16_scales = scales.to(torch.bfloat16).view(torch.uint8)
        return torch.cat([_header(self._tag, numel, carried), bf16_scales, packed])

    def decode(self, blob: torch.Tensor) -> torch.Tensor:
        numel, carried = _read_header(blob, self._tag, self.name)
        packed_bytes = carried * self.block // self._per_byte
        if blob.numel() != _HEADER_BYTES + 2 * carried + packed_bytes or carried > -(-numel // self.block):
            raise ValueError(f"{self.name} encoding of {numel} values has the wrong length {blob.numel()}")
        scales = blob[_HEADER_BYTES : _HEADER_BYTES + 2 * carried].clone().view(torch.bfloat16).float()
        packed = blob[_HEADER_BYTES + 2 * carried :]
        mask = self.levels - 1
        codes = (packed[:, None] >> self._shifts) & mask
        out = torch.zeros(numel, dtype=torch.float32)
        values = self._values(codes.view(-1), scales).view(-1)
        out[: min(numel, values.numel())] = values[:numel]
        return out


class ScoreCodec(Codec):
    """Non-negative scores as powers of two, one byte each: a value's fp32 exponent byte (sign and mantissa
    dropped, so a value is truncated to the power of two at or below it; below fp32's normal range it is 0).
    The sparse ``magnitude`` rule's block scores travel this way: 8 bits per block of 128 values, 1/16 bit per
    value, and an average of them encodes once, like any other average, so every cluster ranks the same
    codes."""

    name, block, wire_ratio = "score", 1, 0.25
    _TAG = 0x5C0

    @staticmethod
    def exponents(values: torch.Tensor) -> torch.Tensor:
        """The exponent byte of every value (int32), refusing NaN/Inf."""
        _check_finite(all_finite(values), "a sparse block score")
        return (values.reshape(-1).view(torch.int32) >> 23) & 255

    def encode(self, values: torch.Tensor, on_grid: bool = False) -> torch.Tensor:
        codes = self.exponents(values.contiguous()).to(torch.uint8)
        return torch.cat([_header(self._TAG, values.numel(), values.numel()), codes])

    def decode(self, blob: torch.Tensor) -> torch.Tensor:
        numel, _ = _read_header(blob, self._TAG, self.name)
        codes = blob[_HEADER_BYTES:]
        if codes.numel() != numel:
            raise ValueError(f"score encoding of {numel} values has {codes.numel()} payload bytes")
        return (codes.to(torch.int32) << 23).view(torch.float32)

    def round_trip_(self, values: torch.Tensor) -> None:
        flat = values.view(-1)
        flat.copy_((self.exponents(flat) << 23).view(torch.float32))


class WireCodecs:
    """The codec of each tensor of a round's buffer, by its index in the averager's tensor list (hivemind's
    ``CompressionInfo.key``): the pseudo-gradient's values (0) and, with the sparse ``magnitude`` rule, the
    block scores (1). An encoding names its codec in its header, so decoding needs no index."""

    def __init__(self, values: Codec, scores: Codec | None = None):
        self.codecs = (values,) if scores is None else (values, scores)
        self._by_tag = {codec_tag(codec): codec for codec in self.codecs}

    @property
    def values(self) -> Codec:
        return self.codecs[0]

    def for_key(self, key) -> Codec:
        return self.codecs[key if isinstance(key, int) and 0 <= key < len(self.codecs) else 0]

    def decode(self, blob: torch.Tensor) -> torch.Tensor:
        if blob.dtype != torch.uint8 or blob.numel() < _HEADER_BYTES:
            raise ValueError(f"not an encoding: {blob.numel()} {blob.dtype} values")
        tag = int(blob[:4].clone().view(torch.int32))
        if tag not in self._by_tag:
            raise ValueError(
                f"an encoding of an unknown codec (tag {tag:#x}); expected {sorted(self._by_tag)}"
            )
        return self._by_tag[tag].decode(blob)


def codec_tag(codec: Codec) -> int:
    """The tag ``codec`` writes in its encodings' headers."""
    return int(codec.encode(torch.zeros(codec.block))[:4].view(torch.int32))
