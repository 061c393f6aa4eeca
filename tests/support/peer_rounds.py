"""The inputs the averager tests' peers average and what a test checks of one peer's round: its result
against the mean of the inputs of the peers the round names (tests/support/averager_peers.py runs them)."""

from __future__ import annotations

import hashlib
import math
import time

import torch


def peer_input(round_id: int, rank: int, numel: int, scores: int = 0) -> torch.Tensor:
    """A peer's input: ``numel`` values, then ``scores`` block scores (powers of two, as the outer loop sends
    them)."""
    generator = torch.Generator().manual_seed(1000 * round_id + rank)
    values = torch.randn(numel, generator=generator)
    return torch.cat([values, 2.0 ** -torch.randint(0, 40, (scores,), generator=generator).float()])


def power_of_two(values: torch.Tensor) -> torch.Tensor:
    """Each non-negative value truncated to the power of two at or below it (0 stays 0), written out."""
    return torch.tensor([2.0 ** math.floor(math.log2(v)) if v > 0 else 0.0 for v in values.tolist()])


def round_result(
    mine: torch.Tensor, inputs: list, rank: int, report, numel: int, started: float, weights=None
) -> dict:
    """What the test checks of one peer's round: its result ``mine`` against the mean of the inputs of the
    peers the round ``report`` names (and of those it did not reject), weighted by ``weights`` if given."""

    def mean_of(ranks: list[int]) -> torch.Tensor:
        stacked = torch.stack([inputs[r] for r in ranks]).double()
        if not weights:
            return stacked.mean(0)
        w = torch.tensor([weights[r] for r in ranks], dtype=torch.float64).unsqueeze(1)
        return (stacked * w).sum(0) / w.sum()

    present = torch.stack([inputs[r] for r in sorted(report.peers)]).double()
    mean = mean_of(sorted(report.peers))
    honest_mean = mean_of([r for r in sorted(report.peers) if r not in report.rejected])
    error = (mine.double() - mean).abs()
    # fp16: every input is rounded on the wire (2^-11 of |x_i|), then the average once more
    fp16_tolerance = 2**-10 * (present.abs().max(0).values + mean.abs()) + 1e-7
    return dict(
        sha256=hashlib.sha256(mine.numpy().tobytes()).hexdigest(),
        rel_err=float(error.max() / mean.abs().max()),
        fp16_ok=bool((error <= fp16_tolerance).all()),
        unchanged=bool(torch.equal(mine, inputs[rank])),
        each_mean_or_own=bool(((error <= 1e-6 * mean.abs().max()) | (mine == inputs[rank])).all()),
        finite=bool(torch.isfinite(mine).all()),
        honest_share=float(
            ((mine.double() - honest_mean).abs() <= 1e-6 * honest_mean.abs().max()).double().mean()
        ),
        wall=time.monotonic() - started,
        # the scores' average, kept to its power of two (what every peer decodes of the reducer's byte)
        scores_are_the_mean=bool(torch.equal(mine[numel:], power_of_two(present[:, numel:].mean(0)))),
    )
