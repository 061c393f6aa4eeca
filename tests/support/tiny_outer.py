"""The smallest outer loop the unit tests of DiLoCo drive: the outer settings they start from, and a one-layer
model holding given values (tests/unit/test_diloco*.py)."""

from __future__ import annotations

import torch

from open_diloco.config import HvConfig


def outer_hv(**overrides) -> HvConfig:
    """Outer settings of the tests: the defaults, one local step, galaxy rank/size as given."""
    settings = dict(local_steps=1, outer_lr=0.7, outer_momentum=0.9, galaxy_size=1, world_rank=0)
    return HvConfig(**{**settings, **overrides})


def linear_model(values: list[float]) -> torch.nn.Module:
    model = torch.nn.Linear(len(values), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values]))
    return model
