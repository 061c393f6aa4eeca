"""What a sparse round (``--hv.compression sparse``) sends of a region: the same share of the values in every
cluster, chosen by a rule every cluster evaluates alike (the round id and, for the ``magnitude`` rule, the
galaxy's block scores), so no indices go on the wire. Pure torch, no hivemind; ``outer/codecs.py`` packs the
selection around a round and ``outer/state.py`` lands it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from open_diloco.outer.encodings import CHUNK, ScoreCodec


class Selection:
    """The values one sparse round sends: their places in the region (``index``, in the order they are packed
    on the wire) and, for the ``magnitude`` rule, the blocks they fill (``blocks``, ascending)."""

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
      scores are averaged in the round itself (a second tensor of the canonical all-reduce, one byte per
      block), so every cluster holds the same ones; ties (every block at the first round) go by a permutation
      seeded by the round id. A block not sent keeps its progress in the model, so its score grows until it is
      sent.
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
        """What round ``round_id`` sends of a region of ``numel`` values; ``scores``: the region's block
        scores (``magnitude``; zeros before the first round)."""
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
        keys = codes * blocks + torch.randperm(
            blocks, generator=generator
        )  # distinct: a total order, no ties
        k = min(blocks, max(1, round(self.density * blocks)))
        chosen = keys.topk(k).indices.sort().values
        index = (chosen[:, None] * SCORE_BLOCK + torch.arange(SCORE_BLOCK)).reshape(-1)
        return Selection(index[index < numel], chosen)

    def unsent_scores(self, dense: torch.Tensor, selection: Selection, dropped: torch.Tensor) -> torch.Tensor:
        """This cluster's score of every block of the region (``magnitude``): the mean square of what it
        leaves unsent there, ``dense`` in the blocks not sent and ``dropped`` (what the encoding dropped,
        packed like the selection) in those sent, as powers of two (:class:`ScoreCodec`)."""
        scores = _block_mean_squares(dense)
        scores[selection.blocks] = _block_mean_squares(dropped)
        ScoreCodec().round_trip_(scores)
        return scores


def _block_mean_squares(values: torch.Tensor) -> torch.Tensor:
    """The mean square of every :data:`SCORE_BLOCK` values of ``values`` (the last block: of the values it
    has), a chunk at a time (no full-size temporary)."""
    numel = values.numel()
    full = numel // SCORE_BLOCK * SCORE_BLOCK
    sums = [piece.view(-1, SCORE_BLOCK).square().sum(1) for piece in values[:full].split(CHUNK)]
    if full < numel:
        sums.append(values[full:].square().sum().view(1))
    out = torch.cat(sums) if sums else values.new_zeros(0)
    out[: full // SCORE_BLOCK].div_(SCORE_BLOCK)
    if full < numel:
        out[-1] /= numel - full
    return out
