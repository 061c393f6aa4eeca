"""The inner optimizer: AdamW with linear warm-up then cosine decay to a floor."""

from __future__ import annotations

import math

import torch


def build_inner_optimizer(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW over all parameters; ``foreach`` keeps the step a handful of kernels per dtype."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, foreach=True)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based): linear ramp, then cosine to the floor."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over :func:`warmup_cosine` (its state is just the step count, so it checkpoints
    trivially)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, total_steps, min_lr_ratio)
    )


def move_scheduler_to(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put the schedule at inner step ``step`` (resume, late join, catching up with the galaxy): the learning
    rate is a pure function of the step, so no scheduler state needs restoring."""
    scheduler.last_epoch = step
    lrs = [
        base_lr * lr_lambda(step)
        for base_lr, lr_lambda in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
