"""The outer state in the shape torch.distributed.checkpoint (DCP) stores and reshards.

The outer loop is a ``Stateful`` (``state_dict()`` / ``load_state_dict()``, as torchtitan's and torchft's
pieces are), so a checkpoint saves and loads it as one thing. Its per-value buffers (the outer momentum, the
error feedback, θ_outer and a round in flight's start) go out as :data:`PIECES`: each split and shaped like
this rank's parameter shards, one tensor per parameter placed like the parameter (a DTensor under FSDP2) and
keyed by the parameter's name, so that DCP stores them as it stores the model and reshards them the same way
when a cluster resumes with another number of ranks. This module holds that placement, both ways.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

PIECES = ("outer_momentum", "error_feedback", "outer_params", "sync_start")
"""The per-value buffers an outer state dict may hold, by their key in it and in a checkpoint."""


def clean_fqn(name: str) -> str:
    """A parameter's name without the wrappers torch.compile and activation checkpointing add: the name
    ``get_state_dict`` gives the model's own entry, so a piece is keyed like the parameter on disk."""
    return name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


def placed_like_params(model: torch.nn.Module, pieces: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``pieces`` (one per parameter, shaped like this rank's shard of it) keyed by parameter name and placed
    like the parameter: a DTensor with its mesh and placements under FSDP2, so DCP can reshard it; the piece
    itself for a parameter that is a plain tensor."""
    placed = {}
    for (name, param), piece in zip(model.named_parameters(), pieces, strict=True):
        local = piece.to(param.device)
        if isinstance(param, DTensor):
            local = DTensor.from_local(
                local,
                device_mesh=param.device_mesh,
                placements=param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        placed[clean_fqn(name)] = local
    return placed


def local_pieces(model: torch.nn.Module, placed: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of :func:`placed_like_params`: this rank's piece of every parameter, in parameter order, on
    CPU (after a load with another number of ranks, DCP has already cut them like this rank's shards)."""
    pieces = []
    for name, _ in model.named_parameters():
        value = placed[clean_fqn(name)]
        pieces.append((value.to_local() if isinstance(value, DTensor) else value).cpu())
    return pieces


def zeros_placed_like_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What DCP loads a piece into (it loads into the tensors it is given): fp32 zeros placed like the
    parameters. fp32 whatever the model's dtype, as every piece is saved in fp32: loading into the model's
    dtype would round it."""
    shards = [p.data.to_local() if isinstance(p.data, DTensor) else p.data for p in model.parameters()]
    return placed_like_params(model, [torch.zeros_like(shard, dtype=torch.float32) for shard in shards])
