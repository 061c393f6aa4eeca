"""The training loop of one cluster. Reads top to bottom: set up, then inner steps, with an outer step
(DiLoCo) every ``--hv.local-steps`` when a galaxy is configured."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from open_diloco.config import Config, check_against_world
from open_diloco.data import build_eval_loader, build_train_loader, plan_data
from open_diloco.diloco import NullOuterLoop, OuterLoop
from open_diloco.metrics import build_metrics
from open_diloco.model import build_model, load_model_config
from open_diloco.optim import build_inner_optimizer, build_scheduler
from open_diloco.parallelize import parallelize, resolve_precision
from open_diloco.world import World, describe_world, join_process_group, leave_process_group


class Stop(Exception):
    """Raised by the SIGTERM handler so the loop unwinds through its ``finally`` blocks."""


def train(config: Config) -> None:
    """Train one cluster according to ``config``. Every check a user can fail runs before ranks talk."""
    world = describe_world(config.device, config.backend)
    grad_accum = check_against_world(config, world.world_size)
    precision = resolve_precision(config.precision, world.device)
    vocab_size = load_model_config(config.path_model).vocab_size
    galaxy_rank, galaxy_size = (config.hv.world_rank, config.hv.galaxy_size) if config.hv else (0, 1)
    data = plan_data(config, vocab_size, world.world_size, galaxy_rank, galaxy_size)
    run_name = config.run_name or f"cluster{galaxy_rank}-{time.strftime('%Y%m%d-%H%M%S')}"

    join_process_group(world)
    signal.signal(signal.SIGTERM, _raise_stop)
    metrics = build_metrics(
        config.metric_logger_type, world.is_main, config.metrics_path, config.project, run_name,
        config.model_dump(mode="json"),
    )
    outer: OuterLoop = NullOuterLoop()
    try:
        model = build_model(config.path_model, config.seed)
        model = parallelize(model, world.device, precision, config.activation_checkpointing, config.torch_compile)
        optimizer = build_inner_optimizer(model, config.lr, config.weight_decay, config.adam_betas)
        scheduler = build_scheduler(optimizer, config.warmup_steps, config.schedule_steps, config.min_lr_ratio)
        batch_args = dict(per_device_batch=config.per_device_train_batch_size, rank=world.rank, world_size=world.world_size)
        loader = build_train_loader(data, **batch_args, num_workers=config.num_workers)
        eval_loader = build_eval_loader(data, **batch_args, steps=config.eval_steps)
        batches = iter(loader)
        tokens_per_step = config.total_batch_size * config.seq_length
        _say(world, f"training {run_name}: {world.world_size} rank(s) on {world.device.type}, {precision}, "
                    f"grad accumulation {grad_accum}, {config.max_steps} steps")

        for step in range(1, config.max_steps + 1):
            started = time.perf_counter()
            loss, grad_norm = inner_step(model, optimizer, batches, grad_accum, config.max_grad_norm, world)
            scheduler.step()
            seconds = time.perf_counter() - started
            record: dict[str, Any] = {
                "step": step,
                "loss": loss,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": grad_norm,
                "tokens_per_second": tokens_per_step / seconds,
                "step_seconds": seconds,
                "memory_gib": _memory_gib(world.device),
            }
            record.update(outer.after_inner_step(step))
            if config.eval_interval and (step % config.eval_interval == 0 or step == config.max_steps):
                record["val_loss"] = evaluate(model, eval_loader, world)
            metrics.log(record)
            if step % config.log_interval == 0 or step == config.max_steps:
                _say(world, format_step_line(record, config.max_steps))
    finally:
        outer.close()
        metrics.close()
        leave_process_group()


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
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if world.world_size > 1:
        dist.all_reduce(loss_sum)
        loss_sum /= world.world_size
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return loss_sum.item(), float(grad_norm)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], world: World) -> float:
    """Mean loss over the held-out batches, averaged over the cluster's ranks (the same batches every time, so
    values compare across steps and clusters)."""
    was_training = model.training
    model.eval()
    loss_sum, count = torch.zeros((), device=world.device), 0
    for batch in batches:
        input_ids = batch["input_ids"].to(world.device, non_blocking=True)
        loss_sum += model(input_ids=input_ids, labels=input_ids).loss
        count += 1
    model.train(was_training)
    if world.world_size > 1:
        dist.all_reduce(loss_sum)
    return loss_sum.item() / (count * world.world_size)


def format_step_line(record: dict[str, Any], max_steps: int) -> str:
    """The per-step line a person scans: step, loss, lr, throughput, memory, and outer-step facts if any."""
    line = (
        f"step {record['step']:>6}/{max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"{record['tokens_per_second'] / 1e3:8.1f}k tok/s | mem {record['memory_gib']:.2f} GiB"
    )
    if "val_loss" in record:
        line += f" | val {record['val_loss']:.4f}"
    if "outer_step" in record:
        line += (
            f" | outer {record['outer_step']} peers {record.get('galaxy_peers', '?')} "
            f"allreduce {record.get('allreduce_seconds', 0.0):.2f}s hash {record.get('param_hash', '?')} "
            f"in_sync {record.get('in_sync', '?')}"
        )
    return line


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / 2**30
    return 0.0


def _say(world: World, message: str) -> None:
    if world.is_main:
        print(message, flush=True)


def _raise_stop(signum: int, frame: Any) -> None:
    raise Stop(f"signal {signum}")
