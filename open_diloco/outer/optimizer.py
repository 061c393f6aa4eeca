"""The outer optimizer: one SGD step with (Nesterov) momentum on the galaxy's averaged pseudo-gradient, in
place on θ_outer, and the schedule of its lr and momentum over the rounds (the warm-up). Pure functions of
their arguments, so every cluster applies the same step; :class:`~open_diloco.outer.state.OuterState` holds
the buffers.
"""

from __future__ import annotations

import torch


def round_hparams(round_no: int, *, lr: float, momentum: float, warmup_rounds: int) -> tuple[float, float]:
    """(outer lr, outer momentum) of outer step ``round_no`` (1-based): a pure function of the round number
    and the config, so every cluster applies the same step, and a resumed or late cluster continues the
    schedule.

    During the first ``warmup_rounds`` rounds both ramp linearly from plain averaging (lr 1, momentum 0) to
    the configured values: round 1 is plain averaging, round ``warmup_rounds + 1`` is the first at full
    settings. Round 1's pseudo-gradient (the model's way out of its random init, many times later rounds')
    then never enters the momentum, which would otherwise carry it on for ~1/(1 − momentum) rounds."""
    if warmup_rounds <= 0 or round_no > warmup_rounds:
        return lr, momentum
    ramp = (round_no - 1) / warmup_rounds
    return 1.0 + ramp * (lr - 1.0), ramp * momentum


@torch.no_grad()
def outer_sgd_step_(
    params: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor | None,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> torch.Tensor | None:
    """One SGD step with (Nesterov) momentum, in place, returning the momentum buffer (created on the first
    step with momentum, ``None`` before). ``grad`` is consumed: it is overwritten by the update direction.

    Bit for bit what ``torch.optim.SGD(lr, momentum, nesterov, dampening=0, weight_decay=0)`` computes (a unit
    test pins it), minus its full-size temporary: torch's Nesterov step writes ``grad + momentum * buf`` into
    a new tensor, here it goes into ``grad``, which the caller no longer needs. With ``momentum == 0`` it is
    plain SGD, θ ← θ − lr·grad (torch refuses Nesterov without momentum; plain averaging is a natural thing to
    ask for), and the buffer is left as it is (a warm-up round with momentum 0 neither reads nor feeds it)."""
    if momentum == 0:
        params.add_(grad, alpha=-lr)
        return momentum_buffer
    if momentum_buffer is None:
        momentum_buffer = grad.clone()
    else:
        momentum_buffer.mul_(momentum).add_(grad)
    if nesterov:
        grad.add_(momentum_buffer, alpha=momentum)
        params.add_(grad, alpha=-lr)
    else:
        params.add_(momentum_buffer, alpha=-lr)
    return momentum_buffer
