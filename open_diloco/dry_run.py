"""``--dry-run``: what an operator runs before a long job. The cluster builds the model exactly as training
does (meta device, sharded, materialised), takes one inner step on random tokens of the configured shape, and
reports its peak memory and the seconds to that step; it joins no galaxy and reads no data."""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import psutil
import torch
import torch.distributed as dist

from open_diloco.config import Config, check_against_world
from open_diloco.materialize import materialize
from open_diloco.model import build_meta_model, load_model_config
from open_diloco.optim import build_inner_optimizer
from open_diloco.outer.state import local_shards
from open_diloco.parallelize import parallelize, resolve_precision
from open_diloco.steps import inner_step
from open_diloco.world import describe_world, join_process_group, leave_process_group

GIB = 2**30


@dataclass(frozen=True)
class DryRunReport:
    """One cluster's start, the worst rank's figure for each (memory in GiB, times in seconds)."""

    ranks: int
    device: str
    precision: str
    params: int
    shard_params: int
    """The largest rank's share of the parameters."""
    host_peak_at_start_gib: float
    """Peak resident memory once the model is materialised, before the step."""
    host_peak_gib: float
    """Peak resident memory through the first step."""
    device_peak_gib: float
    """The CUDA allocator's peak through the first step (0 on CPU)."""
    build_seconds: float
    """Meta build and sharding."""
    materialize_seconds: float
    first_step_seconds: float
    seconds_to_first_step: float
    """From the process's start to the end of the first step (imports and process group included)."""
    loss: float

    def line(self) -> str:
        """The line a person reads."""
        millions = f"{self.params / 1e6:.1f}M params ({self.shard_params / 1e6:.1f}M per rank)"
        seconds = (
            f"build+shard {self.build_seconds:.1f} s, materialise {self.materialize_seconds:.1f} s, "
            f"step {self.first_step_seconds:.1f} s"
        )
        return (
            f"dry run: {self.ranks} rank(s) on {self.device}, {self.precision}, {millions} | first step "
            f"after {self.seconds_to_first_step:.1f} s ({seconds}) | peak host RSS {self.host_peak_gib:.2f} "
            f"GiB per rank ({self.host_peak_at_start_gib:.2f} before the step), device "
            f"{self.device_peak_gib:.2f} GiB | loss {self.loss:.3f}"
        )


def dry_run(config: Config) -> DryRunReport:
    """Build, shard and materialise the model, take one inner step, print the report (rank 0: a line for a
    person, then ``{"dry_run": {...}}`` as JSON) and return it. Collective over the cluster's ranks."""
    world = describe_world(config.device, config.backend)
    grad_accum = check_against_world(config, world.world_size)
    precision = resolve_precision(config.precision, world.device)
    vocab_size = load_model_config(config.path_model).vocab_size
    join_process_group(world)
    try:
        started = time.perf_counter()
        model = build_meta_model(config.path_model)
        model = parallelize(
            model, world.device, precision, config.activation_checkpointing, config.torch_compile
        )
        built = time.perf_counter()
        materialize(model, config.path_model, config.seed, world.device)
        materialized = time.perf_counter()
        at_start = _host_peak()
        optimizer = build_inner_optimizer(model, config.lr, config.weight_decay, config.adam_betas)
        batches = random_batches(vocab_size, config, seed=config.seed + world.rank)
        loss, _ = inner_step(model, optimizer, batches, grad_accum, config.max_grad_norm, world)
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        stepped = time.perf_counter()
        worst = _max_over_ranks(
            [
                at_start,
                _host_peak(),
                torch.cuda.max_memory_allocated(world.device) if world.device.type == "cuda" else 0,
                built - started,
                materialized - built,
                stepped - materialized,
                time.time() - psutil.Process().create_time(),
                sum(shard.numel() for shard in local_shards(model)),
            ],
            world.device,
        )
        report = DryRunReport(
            ranks=world.world_size,
            device=world.device.type,
            precision=precision,
            params=sum(param.numel() for param in model.parameters()),
            shard_params=int(worst[7]),
            host_peak_at_start_gib=worst[0] / GIB,
            host_peak_gib=worst[1] / GIB,
            device_peak_gib=worst[2] / GIB,
            build_seconds=worst[3],
            materialize_seconds=worst[4],
            first_step_seconds=worst[5],
            seconds_to_first_step=worst[6],
            loss=loss,
        )
        if world.is_main:
            print(report.line(), flush=True)
            print(json.dumps({"dry_run": asdict(report)}), flush=True)
        return report
    finally:
        leave_process_group()


def _host_peak() -> float:
    """This process's peak resident memory so far, in bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def random_batches(vocab_size: int, config: Config, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of uniform random tokens in the configured shape: what memory and time depend on."""
    generator = torch.Generator().manual_seed(seed)
    shape = (config.per_device_train_batch_size, config.seq_length)
    while True:
        yield {"input_ids": torch.randint(0, vocab_size, shape, generator=generator)}


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the cluster's ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
