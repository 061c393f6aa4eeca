"""The smallest outer loop the unit tests of DiLoCo drive: the outer settings they start from, and a one-layer
model holding given values, and a galaxy of such clusters in threads (tests/unit/test_diloco*.py,
test_quorum.py)."""

from __future__ import annotations

import threading

import torch

from open_diloco.config import HvConfig
from open_diloco.outer.diloco import DiLoCo


def outer_hv(**overrides) -> HvConfig:
    """Outer settings of the tests: the defaults, one local step, galaxy rank/size as given."""
    settings = dict(local_steps=1, outer_lr=0.7, outer_momentum=0.9, galaxy_size=1, world_rank=0)
    return HvConfig(**{**settings, **overrides})


def linear_model(values: list[float]) -> torch.nn.Module:
    model = torch.nn.Linear(len(values), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values]))
    return model


def run_clusters(galaxy, starts, locals_per_round, **kwargs):
    """Each cluster starts at ``starts``, and before each round sets its local weights to the given values."""
    results = {}

    def cluster(rank: int):
        model = linear_model(starts)
        hv = outer_hv(**{"world_rank": rank, "galaxy_size": galaxy.size, **kwargs})
        outer = DiLoCo(model, galaxy.averager(rank, len(starts)), hv, warn=lambda *_: None)
        records = []
        for local in locals_per_round[rank]:
            with torch.no_grad():
                model.weight.copy_(torch.tensor([local]))
            records.append(outer.after_inner_step(1))
        results[rank] = (model.weight.detach().clone(), records, outer)

    threads = [threading.Thread(target=cluster, args=(r,)) for r in range(galaxy.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results
