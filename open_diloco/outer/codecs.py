"""Lossy encodings of a pseudo-gradient and the error feedback that makes them safe. Pure torch, no hivemind.

Two halves, used on both sides of the wire:

- a :class:`Codec` turns one contiguous run of fp32 values into bytes and back (``encode``/``decode``), and
  rounds values in place to exactly what a decode of their encoding gives (``round_trip_``, no packing);
- a :class:`PseudoGradCompressor` is what the outer loop does around a round: add the error feedback, keep the
  sparse selection, round to the codec's grid (:meth:`~PseudoGradCompressor.to_wire_`), and after the round
  recompute what the encoding dropped (:meth:`~PseudoGradCompressor.residual_`) and spread a sparse average back
  out (:meth:`~PseudoGradCompressor.from_wire_`).

Integer codecs (int8/int4/int2) quantize blocks of ``block`` values on a uniform grid of 2^bits levels spanning
± the block's scale, kept in bf16 (2 bytes per block). The scale is the block's absmax, or for int2 the smaller of
the absmax and 1.5 x the block's RMS (values past it clip to the outer level; the error feedback carries the rest),
truncated to bf16 (never above the absmax). The outer level decodes to exactly the scale, so values already on a
grid encode again to the very same bytes with the absmax rule (``on_grid``): the outer loop rounds Δ before the
round, the senders' wire encoding is lossless, and the error feedback the outer loop computed is exactly what the
wire dropped. Block sizes and the int2 clip were chosen by measurement on real pseudo-gradients
(docs/results/compression.md): absmax beat a ±kσ range at 8 and 4 bits; at 2 bits the 1.5σ clip cut the error.

Blocks are counted from the start of the flat shard buffer; the all-reduce cuts its parts at multiples of
``block`` (the part size is a power of two, see ``galaxy/allreduce.py``), so a part's blocks are the buffer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from open_diloco.errors import OpenDilocoError

_HEADER_WORDS = 3  # int32: codec tag, numel, blocks carried
_HEADER_BYTES = 4 * _HEADER_WORDS
_CHUNK = 1 << 20  # values per round_trip_ slice: bounds temporaries; a multiple of every block size
_FP32_MAX = torch.finfo(torch.float32).max
_BF16_MAX = torch.finfo(torch.bfloat16).max


class NonFiniteDelta(OpenDilocoError):
    """A pseudo-gradient holds NaN or Inf: it is refused, not encoded (the run diverged)."""


def all_finite(values: torch.Tensor) -> bool:
    """Whether ``values`` holds no NaN and no ±Inf, many times faster than ``torch.isfinite(values).all()`` on
    CPU (no full-size boolean tensor): the smallest and largest value are finite iff every value is (both are NaN
    as soon as one value is). Every round checks each part it reduces and the average it applies, inside the time
    a streaming sync has to hide in (docs/overlap.md)."""
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
    """One encoding of a flat fp32 run. ``wire_ratio`` (bytes sent per fp32 byte, nominal) sizes the all-reduce's
    parts: a power of two, so parts start on block boundaries."""

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
    """bf16, round to nearest even: fp32's range, 8 bits of mantissa; 2x smaller than fp32 (values beyond bf16's
    largest finite value are clamped to it)."""

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
        for piece in values.view(-1).split(_CHUNK):
            piece.copy_(self._to_bf16(piece))


class BlockIntCodec(Codec):
    """``bits``-bit uniform quantization per block of ``block`` values, scaled by the block's absmax (see the
    module docstring). Trailing all-zero blocks are not sent (a sparse Δ's empty tail costs 12 bytes)."""

    def __init__(self, bits: int, block: int, clip_sigmas: float | None = None):
        if bits not in (2, 4, 8) or block % 8 or block < 8:
            raise ValueError(f"BlockIntCodec(bits={bits}, block={block}): bits is 2, 4 or 8; block a multiple of 8")
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

    # -- the three entry points -------------------------------------------------------------------------------
    def round_trip_(self, values: torch.Tensor) -> None:
        flat = values.view(-1)
        for piece in flat.split(_CHUNK):
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
    value, and an average of them encodes once, like any other average, so every cluster ranks the same codes."""

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
            raise ValueError(f"an encoding of an unknown codec (tag {tag:#x}); expected {sorted(self._by_tag)}")
        return self._by_tag[tag].decode(blob)


def codec_tag(codec: Codec) -> int:
    """The tag ``codec`` writes in its encodings' headers."""
    return int(codec.encode(torch.zeros(codec.block))[:4].view(torch.int32))


# Block sizes and the int2 clip chosen by measurement (docs/results/compression.md): error vs bytes on real Δ.
CODECS = {
    "bf16": lambda: Bf16Codec(),
    "int8": lambda: BlockIntCodec(8, 256),
    "int4": lambda: BlockIntCodec(4, 64),
    "int2": lambda: BlockIntCodec(2, 128, clip_sigmas=1.5),
}
SPARSE_VALUES = "int2"
"""The codec of the sparse selection's values."""


class Selection:
    """The values one sparse round sends: their places in the region (``index``, in the order they are packed on
    the wire) and, for the ``magnitude`` rule, the blocks they fill (``blocks``, ascending)."""

    def __init__(self, index: torch.Tensor, blocks: torch.Tensor | None = None):
        self.index, self.blocks = index, blocks

    @property
    def numel(self) -> int:
        return self.index.numel()

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """The selected values of ``flat``, packed (a copy)."""
        return flat[self.index]

    def scatter_(self, flat: torch.Tensor, compact: torch.Tensor) -> None:
        """Write ``compact`` (a :meth:`gather` output) back to the selected places of ``flat``."""
        flat[self.index] = compact


SCORE_BLOCK = 128
"""Values per block of the ``magnitude`` rule: one score byte each (1/16 bit per value on the wire)."""


@dataclass(frozen=True)
class SparseSelection:
    """The same ``density`` share of the values in every cluster, with no indices on the wire. Rules:

    - ``magnitude``: whole blocks of :data:`SCORE_BLOCK` values, those with the largest score, where a block's
      score is the galaxy's mean, over clusters, of the mean square of what each left unsent in it the round
      before (all of it in a block not sent; what the 2-bit encoding dropped in one sent), a power of two. The
      scores are averaged in the round itself (a second tensor of the canonical all-reduce, one byte per block),
      so every cluster holds the same ones; ties (every block at the first round) go by a permutation seeded by
      the round id. A block not sent keeps its progress in the model, so its score grows until it is sent.
    - ``random``: ``k`` of every ``chunk`` columns, drawn from a generator seeded by the round id;
    - ``cyclic``: a window of ``k`` columns sliding by ``k`` each round (every value once every ``chunk/k``
      rounds). For these two every chunk uses the same columns."""

    density: float
    rule: str = "magnitude"
    chunk: int = 4096

    @property
    def scored(self) -> bool:
        """Whether the selection needs the galaxy's block scores (the ``magnitude`` rule)."""
        return self.rule == "magnitude"

    @property
    def per_chunk(self) -> int:
        return max(1, round(self.density * self.chunk))

    def score_blocks(self, numel: int) -> int:
        """How many scores a region of ``numel`` values has (0 for the unscored rules)."""
        return -(-numel // SCORE_BLOCK) if self.scored else 0

    def columns(self, round_id: int) -> torch.Tensor:
        k = self.per_chunk
        if self.rule == "cyclic":
            return ((round_id * k + torch.arange(k)) % self.chunk).sort().values
        if self.rule == "random":
            generator = torch.Generator().manual_seed(0x5BA25E + round_id)
            return torch.randperm(self.chunk, generator=generator)[:k].sort().values
        raise ValueError(f"unknown sparse rule {self.rule!r}")

    def select(self, numel: int, round_id: int, scores: torch.Tensor | None = None) -> Selection:
        """What round ``round_id`` sends of a region of ``numel`` values; ``scores``: the region's block scores
        (``magnitude``; zeros before the first round)."""
        if self.scored:
            return self._top_blocks(numel, round_id, scores)
        columns = self.columns(round_id)
        rows = numel // self.chunk
        body = (torch.arange(rows)[:, None] * self.chunk + columns).reshape(-1)
        tail = rows * self.chunk + columns[columns < numel - rows * self.chunk]
        return Selection(torch.cat([body, tail]))

    def _top_blocks(self, numel: int, round_id: int, scores: torch.Tensor | None) -> Selection:
        blocks = self.score_blocks(numel)
        codes = torch.zeros(blocks, dtype=torch.int64)
        if scores is not None:
            codes = ScoreCodec.exponents(scores[:blocks]).long()
        generator = torch.Generator().manual_seed(0x5C0BE + round_id)
        keys = codes * blocks + torch.randperm(blocks, generator=generator)  # distinct: a total order, no ties
        k = min(blocks, max(1, round(self.density * blocks)))
        chosen = keys.topk(k).indices.sort().values
        index = (chosen[:, None] * SCORE_BLOCK + torch.arange(SCORE_BLOCK)).reshape(-1)
        return Selection(index[index < numel], chosen)

    def unsent_scores(self, dense: torch.Tensor, selection: Selection, dropped: torch.Tensor) -> torch.Tensor:
        """This cluster's score of every block of the region (``magnitude``): the mean square of what it leaves
        unsent there, ``dense`` in the blocks not sent and ``dropped`` (what the encoding dropped, packed like the
        selection) in those sent, as powers of two (:class:`ScoreCodec`)."""
        scores = _block_mean_squares(dense)
        scores[selection.blocks] = _block_mean_squares(dropped)
        ScoreCodec().round_trip_(scores)
        return scores


def _block_mean_squares(values: torch.Tensor) -> torch.Tensor:
    """The mean square of every :data:`SCORE_BLOCK` values of ``values`` (the last block: of the values it has),
    a chunk at a time (no full-size temporary)."""
    numel = values.numel()
    full = numel // SCORE_BLOCK * SCORE_BLOCK
    sums = [piece.view(-1, SCORE_BLOCK).square().sum(1) for piece in values[:full].split(_CHUNK)]
    if full < numel:
        sums.append(values[full:].square().sum().view(1))
    out = torch.cat(sums) if sums else values.new_zeros(0)
    out[: full // SCORE_BLOCK].div_(SCORE_BLOCK)
    if full < numel:
        out[-1] /= numel - full
    return out


class PseudoGradCompressor:
    """What a lossy ``--hv.compression`` does to one shard's Δ around a round, with error feedback ``e``:

    before: Δ_fb = Δ + e, and the buffer gets Q(Δ_fb) (sparse: Q of the selected values, packed at the front of
    the buffer, zeros behind them, so the wire carries only those);
    after: e ← Δ_fb − Q(Δ_fb) (dense codecs; a sparse round keeps what it did not send in the model instead, see
    ``OuterState.land``), and a sparse average is spread back to its places. The round's result is the reducer's
    decode(encode(average)), identical in every cluster."""

    def __init__(self, codec: Codec, sparse: SparseSelection | None = None):
        self.codec, self.sparse = codec, sparse

    def to_wire_(self, flat: torch.Tensor, error: torch.Tensor | None, selection: Selection | None = None,
                 scores: torch.Tensor | None = None) -> None:
        """Δ in ``flat`` → what this cluster sends (in place). ``error`` is read, not changed: a retried round
        sends the same again. Sparse: ``selection`` says what is sent; with the ``magnitude`` rule this cluster's
        block scores go into ``scores`` (the buffer's second tensor)."""
        if error is not None:
            flat.add_(error)
        if self.sparse is None:
            self.codec.round_trip_(flat)
            return
        compact = selection.gather(flat)
        sent = compact.clone()
        self.codec.round_trip_(sent)
        if scores is not None:
            own = self.sparse.unsent_scores(flat, selection, compact.sub_(sent))
            scores.zero_()
            scores[: own.numel()] = own
        flat.zero_()
        flat[: sent.numel()] = sent

    def residual_(self, error: torch.Tensor) -> None:
        """``error`` holds Δ_fb = Δ + e on entry; leaves Δ_fb − Q(Δ_fb), the same rounding :meth:`to_wire_` did
        (dense codecs: a sparse round keeps no error-feedback buffer)."""
        for piece in error.split(_CHUNK):
            sent = piece.clone()
            self.codec.round_trip_(sent)
            piece.sub_(sent)

    def from_wire_(self, flat: torch.Tensor, selection: Selection | None = None) -> None:
        """The round's result in ``flat`` → a dense averaged Δ (sparse: the packed values back to their places)."""
        if self.sparse is None:
            return
        compact = flat[: selection.numel].clone()
        flat.zero_()
        selection.scatter_(flat, compact)


def build_compressor(compression: str, sparse_density: float, sparse_rule: str) -> PseudoGradCompressor | None:
    """The outer loop's side of ``--hv.compression``; ``None`` for the codecs hivemind applies alone (none, fp16)."""
    if compression == "sparse":
        return PseudoGradCompressor(CODECS[SPARSE_VALUES](), SparseSelection(sparse_density, sparse_rule))
    if compression in CODECS:
        return PseudoGradCompressor(CODECS[compression]())
    return None


def wire_codecs(compression: str, sparse_rule: str) -> WireCodecs | None:
    """The galaxy's side of ``--hv.compression``: the codecs the all-reduce encodes its tensors' parts with
    (``None``: hivemind's own serialization)."""
    if compression == "sparse":
        scores = ScoreCodec() if SparseSelection(1.0, sparse_rule).scored else None
        return WireCodecs(CODECS[SPARSE_VALUES](), scores)
    return WireCodecs(CODECS[compression]()) if compression in CODECS else None


def score_values(numel: int, compression: str, sparse_rule: str) -> int:
    """How many block scores ride a round of ``numel`` values beside them (the averager's second tensor; 0: none)."""
    return SparseSelection(1.0, sparse_rule).score_blocks(numel) if compression == "sparse" else 0


def codec_label(compression: str, sparse_density: float, sparse_rule: str) -> str:
    """``--hv.compression`` with what else every cluster must share to average (the membership schema's
    ``codec``): a sparse round's density and rule decide which values it packs."""
    return f"sparse {sparse_rule} {sparse_density:g}" if compression == "sparse" else compression
