"""One inner step of a cluster, and one evaluation: the work between two syncs, and its record.

The trainer (``trainer.train``) decides at which galaxy steps this cluster trains and what happens around
them; this module is what a step does on the device, apart so that benches and the dry run take the very same
step."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from open_diloco.optim import move_scheduler_to

if TYPE_CHECKING:
    from open_diloco.config import Config
    from open_diloco.world import World


def train_step(
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[dict[str, torch.Tensor]],
    scheduler: Any,
    grad_accum: int,
    config: Config,
    world: World,
) -> dict[str, Any]:
    """Inner step ``step`` (:func:`inner_step`) and the lr after it; its record (:func:`step_record`)."""
    started = time.perf_counter()
    loss, grad_norm = inner_step(model, optimizer, batches, grad_accum, config.max_grad_norm, world)
    scheduler.step()
    seconds = time.perf_counter() - started
    return step_record(step, loss, grad_norm, scheduler, seconds, config, world)


def pass_step(step: int, latest: dict[str, Any], scheduler: Any) -> dict[str, Any]:
    """Galaxy step ``step``, at which this cluster takes no inner step (``--hv.round-steps by-speed``: a
    slower cluster takes part of a stride's steps): the lr goes to the galaxy step's (set, not stepped: torch
    warns of a scheduler step before an optimizer step). Its record is logged only when a sync ends or an
    evaluation runs there: loss, grad_norm and throughput are the latest inner step's (``latest``), and there
    is no ``step_seconds`` (no step was timed)."""
    move_scheduler_to(scheduler, step)
    carried = {key: value for key, value in latest.items() if key not in ("step_seconds", "val_loss")}
    return {
        "loss": float("nan"),
        "grad_norm": float("nan"),
        "tokens_per_second": 0.0,
        "memory_gib": 0.0,
        **carried,
        "step": step,
        "lr": scheduler.get_last_lr()[0],
        "trained": False,
    }


def step_record(
    step: int, loss: float, grad_norm: float, scheduler: Any, seconds: float, config: Config, world: World
) -> dict[str, Any]:
    """The metrics of inner step ``step`` that took ``seconds``: what the step line shows and the metrics log
    keeps (an outer step adds its own, :func:`add_sync_metrics`)."""
    return {
        "step": step,
        "loss": loss,
        "lr": scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        "tokens_per_second": config.total_batch_size * config.seq_length / seconds,
        "step_seconds": seconds,
        "memory_gib": _memory_gib(world.device),
        "trained": True,
    }


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[dict[str, torch.Tensor]],
    grad_accum: int,
    max_grad_norm: float,
    world: World,
) -> tuple[float, float]:
    """One AdamW step over ``grad_accum`` micro-batches; returns (cluster-mean loss, pre-clip grad norm)."""
    loss_sum = torch.zeros((), device=world.device)
    for micro in range(grad_accum):
        input_ids = next(batches)["input_ids"].to(world.device, non_blocking=True)
        # Reduce-scatter gradients only after the last micro-batch.
        model.set_requires_gradient_sync(micro == grad_accum - 1)
        loss = model(input_ids=input_ids, labels=input_ids).loss / grad_accum
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if world.world_size > 1:
        dist.all_reduce(loss_sum)
        loss_sum /= world.world_size
    loss, norm = torch.stack([loss_sum, grad_norm.to(loss_sum.dtype)]).tolist()  # one host sync per step
    return loss, norm


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], world: World) -> float:
    """Mean loss per held-out sample over the cluster's ranks (the same samples every time, whatever the batch
    size: ``data.build_eval_loader``), so values compare across steps, clusters and runs. A batch weighs as
    many samples as it holds: the last one of a rank may be short."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=world.device)  # Σ loss × samples, Σ samples
    for batch in batches:
        input_ids = batch["input_ids"].to(world.device, non_blocking=True)
        totals[0] += model(input_ids=input_ids, labels=input_ids).loss.double() * len(input_ids)
        totals[1] += len(input_ids)
    model.train(was_training)
    if world.world_size > 1:
        dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def _memory_gib(device: torch.device) -> float:
    """Peak memory of this rank so far (`memory_gib`, docs/configuration.md): the CUDA allocator's peak on a
    GPU, the process's peak resident set (ru_maxrss, KiB on Linux) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
