"""Lossy encodings of a pseudo-gradient and the error feedback that makes them safe. Pure torch, no hivemind.

Two halves, used on both sides of the wire:

- a :class:`~open_diloco.outer.encodings.Codec` (``outer/encodings.py``, which says how each one encodes)
  turns one contiguous run of fp32 values into bytes and back (``encode``/``decode``), and rounds values in
  place to exactly what a decode of their encoding gives (``round_trip_``, no packing);
- a :class:`PseudoGradCompressor` is what the outer loop does around a round: add the error feedback, keep
  the sparse selection (``outer/sparse.py``), round to the codec's grid
  (:meth:`~PseudoGradCompressor.to_wire_`), and after the round recompute what the encoding dropped
  (:meth:`~PseudoGradCompressor.residual_`) and spread a sparse average back out
  (:meth:`~PseudoGradCompressor.from_wire_`).

This module maps ``--hv.compression`` to both (:func:`build_compressor`, :func:`wire_codecs`).
"""

from __future__ import annotations

import torch

from open_diloco.outer.encodings import CHUNK, Bf16Codec, BlockIntCodec, Codec, ScoreCodec, WireCodecs

# Re-exported: outer/round.py and galaxy/allreduce.py check each round with it, imported from here.
from open_diloco.outer.encodings import all_finite as all_finite
from open_diloco.outer.sparse import Selection, SparseSelection

# Block sizes and the int2 clip chosen by measurement (docs/results/compression.md): error vs bytes on real Δ.
CODECS = {
    "bf16": lambda: Bf16Codec(),
    "int8": lambda: BlockIntCodec(8, 256),
    "int4": lambda: BlockIntCodec(4, 64),
    "int2": lambda: BlockIntCodec(2, 128, clip_sigmas=1.5),
}
SPARSE_VALUES = "int2"
"""The codec of the sparse selection's values."""


class PseudoGradCompressor:
    """What a lossy ``--hv.compression`` does to one shard's Δ around a round, with error feedback ``e``:

    before: Δ_fb = Δ + e, and the buffer gets Q(Δ_fb) (sparse: Q of the selected values, packed at the front
    of the buffer, zeros behind them, so the wire carries only those);
    after: e ← Δ_fb − Q(Δ_fb) (dense codecs; a sparse round keeps what it did not send in the model instead,
    see ``OuterState.land``), and a sparse average is spread back to its places. The round's result is the
    reducer's decode(encode(average)), identical in every cluster."""

    def __init__(self, codec: Codec, sparse: SparseSelection | None = None):
        self.codec, self.sparse = codec, sparse

    def to_wire_(
        self,
        flat: torch.Tensor,
        error: torch.Tensor | None,
        selection: Selection | None = None,
        scores: torch.Tensor | None = None,
    ) -> None:
        """Δ in ``flat`` → what this cluster sends (in place). ``error`` is read, not changed: a retried round
        sends the same again. Sparse: ``selection`` says what is sent; with the ``magnitude`` rule this
        cluster's block scores go into ``scores`` (the buffer's second tensor)."""
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
        """``error`` holds Δ_fb = Δ + e on entry; leaves Δ_fb − Q(Δ_fb), the same rounding :meth:`to_wire_`
        did (dense codecs: a sparse round keeps no error-feedback buffer)."""
        for piece in error.split(CHUNK):
            sent = piece.clone()
            self.codec.round_trip_(sent)
            piece.sub_(sent)

    def from_wire_(self, flat: torch.Tensor, selection: Selection | None = None) -> None:
        """The round's result in ``flat`` → a dense averaged Δ (sparse: the packed values back to their
        places)."""
        if self.sparse is None:
            return
        compact = flat[: selection.numel].clone()
        flat.zero_()
        selection.scatter_(flat, compact)


def build_compressor(
    compression: str, sparse_density: float, sparse_rule: str
) -> PseudoGradCompressor | None:
    """The outer loop's side of ``--hv.compression``; ``None`` for the codecs hivemind applies alone (none,
    fp16)."""
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
    """How many block scores ride a round of ``numel`` values beside them (the averager's second tensor; 0:
    none)."""
    return SparseSelection(1.0, sparse_rule).score_blocks(numel) if compression == "sparse" else 0


def codec_label(compression: str, sparse_density: float, sparse_rule: str) -> str:
    """``--hv.compression`` with what else every cluster must share to average (the membership schema's
    ``codec``): a sparse round's density and rule decide which values it packs."""
    return f"sparse {sparse_rule} {sparse_density:g}" if compression == "sparse" else compression
