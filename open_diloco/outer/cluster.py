"""Agreement between the ranks of one cluster: every local rank must take the same decision about a round
(retry, re-sync, adopt a download), else the shards of one model would follow different galaxy states."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class ClusterComm:
    """Small collectives over the cluster's process group, or trivial for a single process.

    Kept tiny and injectable so the outer loop can be tested without a process group. ``device`` is where the
    backend wants its tensors (CUDA for nccl, CPU for gloo)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def _group_active(self) -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the cluster's ranks (``-min_int(-x)`` is the largest)."""
        tensor = torch.tensor([float(value)], device=self.device)
        if self._group_active():
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def all_true(self, value: bool) -> bool:
        """True iff ``value`` is true on every rank."""
        return self.min_int(int(value)) == 1

    def sum_float(self, value: float) -> float:
        """``value`` summed over the cluster's ranks, in fp64."""
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self._group_active():
            dist.all_reduce(tensor)
        return float(tensor.item())

    def norm(self, local_sq: float) -> float | None:
        """The whole cluster's norm from each rank's squared norm of its shard (a ‖Δ‖, a bound on it);
        ``None`` when not finite or never computed (JSON has no NaN)."""
        total = self.sum_float(local_sq)
        return total**0.5 if math.isfinite(total) else None

    def gather_strings(self, value: str) -> list[str]:
        """Every rank's ``value``, in rank order."""
        if not self._group_active():
            return [value]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered

    def broadcast_strings(self, values: list[str]) -> list[str]:
        """Rank 0's ``values`` on every rank (the others' are ignored)."""
        if not self._group_active():
            return values
        box: list[Any] = [values]
        dist.broadcast_object_list(box, src=0)
        return box[0]
