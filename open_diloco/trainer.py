"""The training loop of one cluster. Reads top to bottom: set up, then inner steps, with an outer step
(DiLoCo) every ``--hv.local-steps`` when a galaxy is configured."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from open_diloco import checkpoint
from open_diloco.config import Config, HvConfig, check_against_world
from open_diloco.data import DealtBatches, build_eval_loader, build_train_loader, plan_data
from open_diloco.errors import ConfigError, Stop
from open_diloco.gc_schedule import GcSchedule
from open_diloco.logs import log_from_every_rank
from open_diloco.materialize import materialize
from open_diloco.metrics import build_metrics
from open_diloco.model import build_meta_model, load_model_config, model_fingerprint, shape_fields
from open_diloco.optim import build_inner_optimizer, build_scheduler, move_scheduler_to
from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.loop import NullOuterLoop, OuterLoop
from open_diloco.outer.state import local_shards
from open_diloco.outer.streaming import fragment_length
from open_diloco.output_paths import ensure_run_outputs_writable
from open_diloco.parallelize import parallelize, resolve_precision
from open_diloco.sample_log import open_sample_log
from open_diloco.shutdown import StopGuard
from open_diloco.steps import evaluate, pass_step, train_step
from open_diloco.world import (
    World,
    describe_world,
    env_flag,
    join_process_group,
    leave_process_group,
    process_group_timeout,
)

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from open_diloco.data import DataPlan
    from open_diloco.galaxy.build import GalaxyPart
    from open_diloco.metrics import Metrics
    from open_diloco.outer.round_result import RoundResult

log = logging.getLogger(__name__)


def train(config: Config) -> None:
    """Train one cluster according to ``config``. Every check a user can fail runs before ranks talk."""
    world = describe_world(config.device, config.backend)
    grad_accum = check_against_world(config, world.world_size)
    precision = resolve_precision(config.precision, world.device)
    model_config = load_model_config(config.path_model).to_dict()
    resume = checkpoint.resolve_resume(config.ckpt, model_config)
    galaxy_rank, galaxy_size = (config.hv.world_rank, config.hv.galaxy_size) if config.hv else (0, 1)
    log_from_every_rank(galaxy_rank, world.rank, world.local_rank, env_flag("LOG_LEVEL"))
    data = plan_data(config, model_config["vocab_size"], world.world_size, galaxy_rank, galaxy_size)
    run_name = config.run_name or f"cluster{galaxy_rank}-{time.strftime('%Y%m%d-%H%M%S')}"
    ensure_run_outputs_writable(config, world.is_main)
    sample_log = open_sample_log(config.sample_log, run_name, galaxy_rank, world.rank)

    guard = StopGuard().install()
    gc_schedule = GcSchedule(config.gc_interval)  # collections between steps, not inside them
    join_process_group(world, process_group_timeout(config.hv))
    metrics = start_metrics(config, world, run_name, resume)
    outer: OuterLoop = NullOuterLoop()
    saver = checkpoint.CheckpointSaver(
        config.ckpt.path, config.ckpt.keep, config.model_dump(mode="json"), model_config
    )
    ending = "stopped"  # how the run ended, for the status board
    try:
        model, outer = build_model_and_outer_loop(config, world, precision, model_config)
        optimizer, scheduler = build_optimizer_and_schedule(model, config)
        loader, eval_loader = build_loaders(config, data, world, grad_accum)
        loader = sample_log.watch(loader)
        start_step = resume_from(resume, model, optimizer, outer, world) if resume is not None else 0
        start_step = max(start_step, outer.join_galaxy())
        if outer.joined is not None:  # the checkpoint's training is gone: the metrics say so (audit-data)
            metrics.log(outer.joined)
        batches = feed_at(start_step, outer, loader, scheduler, grad_accum)
        _say(world, format_start_line(run_name, world, precision, grad_accum, start_step, config.max_steps))

        step = start_step
        latest: dict[str, Any] = {}  # the record of this cluster's latest inner step
        while step < config.max_steps:
            step += 1
            trains = outer.trains_at(step)  # a slower cluster's share of a stride may be done (by-speed)
            gc_schedule.collect_if_due(step)
            if trains:
                record = latest = train_step(
                    step, model, optimizer, batches(step), scheduler, grad_accum, config, world
                )
                sample_log.record(step, outer.data_position(step), outer.page_at(step))
            else:
                record = pass_step(step, latest, scheduler)
            syncs = outer.syncs_after_inner_step(step, last=step == config.max_steps, trained=trains)
            record["inner_steps"] = outer.data_position(step)
            add_sync_metrics(record, syncs, metrics, data.epoch_pages(config.total_batch_size))
            if any(sync.diverged for sync in syncs):
                # diverged: the weights came back from the galaxy, AdamW's moments start afresh
                optimizer.state.clear()
            if (galaxy_step := outer.go_on_from(step)) != step:  # back on the galaxy's clock (a take, a hold)
                step = _on_galaxy_clock(world, step, min(galaxy_step, config.max_steps))
                batches = feed_at(step, outer, loader, scheduler, grad_accum)
            if config.eval_interval and (step % config.eval_interval == 0 or step == config.max_steps):
                record["val_loss"] = evaluate(model, eval_loader, world)
            if trains or syncs or "val_loss" in record:  # an idle step says something only then
                publish(record, metrics, outer)
                if step % config.log_interval == 0 or step == config.max_steps:
                    _say(world, format_step_line(record, config.max_steps))
            if step == config.max_steps and (settled := outer.settle_run()) is not None:
                publish({**record, **settled.metrics()}, metrics, outer)  # a record of its own, when it ended
            if config.ckpt.interval and step % config.ckpt.interval == 0:
                saver.start(step, model=model, optimizer=optimizer, outer=outer)  # written in the background
        saver.wait()  # the run's last checkpoint is complete before the run counts as finished
        ending = "finished"
    except Stop as stop:
        _say(world, f"stopping: {stop.reason}")
        ending = f"stopped ({stop.reason})"
        raise SystemExit(stop.exit_code) from None
    except Exception as err:
        ending = f"failed ({log_failure(err)[:200]})"
        raise
    finally:
        end_run(ending, guard, saver, outer, metrics, sample_log, gc_schedule)


def end_run(
    ending: str, guard: StopGuard, saver: checkpoint.CheckpointSaver, outer: OuterLoop, *parts
) -> None:
    """What every run does on its way out, however it ended (``ending``): no more signals taken as a stop, the
    checkpoint being written finished or abandoned (bounded), the galaxy told how the cluster ended and left,
    the run's other ``parts`` closed, and the process group left (in step with the other ranks only after a
    finished run: after a failure a sibling may never come)."""
    guard.begin_shutdown()
    saver.close(timeout=checkpoint.SAVE_GRACE_SECONDS)  # a stopped run: bounded wait, then abandon
    outer.report({"state": ending})
    outer.close()
    for part in parts:
        part.close()
    leave_process_group(synchronize=ending == "finished")


def build_sharded_model(config: Config, world: World, precision: str) -> torch.nn.Module:
    """The model of ``--path-model`` sharded over the cluster's ranks before any weight exists (built on the
    meta device), then each rank's shards allocated and filled: from the model's files, or fresh from
    ``--seed`` (the same θ whatever the rank count)."""
    model = build_meta_sharded_model(config, world, precision)
    return materialize(model, config.path_model, config.seed, world.device)


def build_meta_sharded_model(config: Config, world: World, precision: str) -> torch.nn.Module:
    """The model of ``--path-model`` on the meta device, sharded over the cluster's ranks: shapes, names and
    each rank's shard sizes, no storage yet."""
    model = build_meta_model(config.path_model)
    return parallelize(model, world.device, precision, config.activation_checkpointing, config.torch_compile)


def build_model_and_outer_loop(
    config: Config, world: World, precision: str, model_config: dict[str, Any]
) -> tuple[torch.nn.Module, OuterLoop]:
    """The sharded, materialised model and its outer loop. This rank's part of the galaxy starts in between,
    while the model is still on the meta device: hivemind's DHT and averager are processes *forked* from
    this one, and forked after the weights exist each would hold a copy-on-write image of them that every
    inner step turns into a private copy (in a CPU run, one more fp32 shard per fork:
    docs/results/outer-memory.md)."""
    model = build_meta_sharded_model(config, world, precision)
    tokens_per_step = config.total_batch_size * config.seq_length
    galaxy = start_galaxy(config.hv, model, world, model_config, (config.total_batch_size, config.seq_length))
    try:
        materialize(model, config.path_model, config.seed, world.device)
        return model, build_outer_loop(config.hv, model, galaxy, tokens_per_step)
    except BaseException:
        if galaxy is not None:
            galaxy[0].averager.shutdown()  # the trainer's `finally` only knows the outer loop, not yet made
        raise


def build_optimizer_and_schedule(
    model: torch.nn.Module, config: Config
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The inner AdamW and its warm-up + cosine schedule."""
    optimizer = build_inner_optimizer(model, config.lr, config.weight_decay, config.adam_betas)
    return optimizer, build_scheduler(
        optimizer, config.warmup_steps, config.schedule_steps, config.min_lr_ratio
    )


def start_metrics(
    config: Config, world: World, run_name: str, resume: tuple[Path, dict[str, Any]] | None
) -> Metrics:
    """The run's metrics sink, its start record saying what it resumed from and how often torchrun restarted
    the cluster; a restarted cluster says so in its log too (what an operator looks for after a rank died)."""
    resumed_from = resume[0] if resume else None
    if world.restarts:
        where = f"resuming from {resumed_from}" if resume else "no checkpoint to resume from: starting fresh"
        _say(world, f"torchrun restarted this cluster (restart {world.restarts}): {where}")
    return build_metrics(config, world.is_main, run_name, resumed_from=resumed_from, restarts=world.restarts)


def resume_from(
    resume: tuple[Path, dict[str, Any]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: OuterLoop,
    world: World,
) -> int:
    """Load the checkpoint ``resume`` names (from ``checkpoint.resolve_resume``) into the model, the inner
    optimizer and the outer loop; returns the inner step it was saved at."""
    step = checkpoint.load(*resume, model=model, optimizer=optimizer, outer=outer)
    _say(world, f"resumed from {resume[0]} at step {step}")
    return step


def build_loaders(
    config: Config, data: DataPlan, world: World, grad_accum: int
) -> tuple[StatefulDataLoader, DataLoader]:
    """This rank's training loader and its held-out evaluation batches."""
    batch_args = dict(
        per_device_batch=config.per_device_train_batch_size, rank=world.rank, world_size=world.world_size
    )
    loader = build_train_loader(data, **batch_args, num_workers=config.num_workers, grad_accum=grad_accum)
    eval_loader = build_eval_loader(data, **batch_args, samples=config.eval_samples)
    return loader, eval_loader


def publish(record: dict[str, Any], metrics: Metrics, outer: OuterLoop) -> None:
    """An inner step's record into the metrics, and to the galaxy's status board."""
    metrics.log(record)
    outer.report(record)


def add_sync_metrics(
    record: dict[str, Any], syncs: list[RoundResult], metrics: Metrics, epoch_pages: float | None = None
) -> None:
    """The metrics of the syncs (outer steps) that ended at this step into its ``record``. Two end at one step
    with ``--hv.sync-delay`` = H/P: the earlier one is logged at once, as a line of its own. With pages of a
    corpus dealt (``epoch_pages`` a pass over it), the epoch the deal's cursor is in (``data_epoch``)."""
    ended = [sync.metrics() for sync in syncs]
    for sync in ended:
        if epoch_pages and sync.get("data_cursor") is not None:
            sync["data_epoch"] = sync["data_cursor"] / epoch_pages
    for earlier in ended[:-1]:
        metrics.log({**record, **earlier})
    record.update(ended[-1] if ended else {})


def log_failure(err: Exception) -> str:
    """The first line of the error a run failed with, logged with when and on which rank (the traceback
    follows) unless it is a user error, which ``cli/app.py`` already prints as one line on every rank."""
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not isinstance(err, ConfigError):
        log.error("training stopped: %s", first_line)
    return first_line


def position_at(
    step: int, data_step: int, loader: Any, scheduler: Any, grad_accum: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches and learning rate for continuing after galaxy step ``step``, this cluster having taken
    ``data_step`` inner steps (the same number unless ``--hv.round-steps by-speed``). Both are pure functions
    of the two, which is what makes resume, late join and catching up with the galaxy the same operation."""
    loader.sampler.next_block = data_step * grad_accum
    move_scheduler_to(scheduler, step)
    return iter(loader)


def feed_at(
    step: int, outer: OuterLoop, loader: Any, scheduler: Any, grad_accum: int
) -> Callable[[int], Iterator[dict[str, torch.Tensor]]]:
    """The batches of each inner step after galaxy step ``step``: the cluster's own part from where its data
    goes on (:func:`position_at`), or in an elastic galaxy the pages the ledger dealt each step
    (``data.DealtBatches``)."""
    if outer.pages_from(step + 1) is None:
        batches = position_at(step, outer.data_position(step), loader, scheduler, grad_accum)
        return lambda _step: batches
    move_scheduler_to(scheduler, step)
    return DealtBatches(loader, outer.page_at, outer.pages_from, grad_accum).at


def start_galaxy(
    hv: HvConfig | None,
    model: torch.nn.Module,
    world: World,
    model_config: dict[str, Any],
    step_shape: tuple[int, int] = (0, 0),
) -> tuple[GalaxyPart, ClusterComm] | None:
    """This rank's part of the galaxy when one is configured (``galaxy/build.py``): each local rank averages
    its own FSDP shard with the same shard of every other cluster. ``model`` may still be on the meta device:
    only its names and shard sizes are read. ``step_shape``: (samples, tokens each) of one inner step."""
    if hv is None:
        return None
    from open_diloco.galaxy.build import ClusterShard, join_galaxy  # hivemind, loaded only when needed

    shard = ClusterShard(
        index=world.rank,
        ranks=world.world_size,
        numel=fragment_length(sum(shard.numel() for shard in local_shards(model)), hv.fragments),
        model_fingerprint=model_fingerprint(model),
        model_config=shape_fields(model_config),
        tokens_per_step=step_shape[0] * step_shape[1],
        samples_per_step=step_shape[0],
    )
    cluster = ClusterComm(world.device)
    return join_galaxy(hv, shard, cluster), cluster


def build_outer_loop(
    hv: HvConfig | None,
    model: torch.nn.Module,
    galaxy: tuple[GalaxyPart, ClusterComm] | None,
    tokens_per_step: int = 1,
) -> OuterLoop:
    """DiLoCo over ``galaxy`` (from :func:`start_galaxy`; the model materialised since), else the no-op
    loop; ``tokens_per_step``: what a round's ledger entry counts as committed work per inner step."""
    if galaxy is None:
        return NullOuterLoop()
    part, cluster = galaxy
    outer_log = logging.getLogger("open_diloco.outer")
    return DiLoCo(
        model,
        part.averager,
        hv,
        cluster=cluster,
        warn=outer_log.warning,
        status=part.status,
        tokens_per_step=tokens_per_step,
    )


def format_start_line(
    run_name: str, world: World, precision: str, grad_accum: int, start_step: int, max_steps: int
) -> str:
    """The line a run starts with: its name, where it trains, and the steps it will take."""
    return (
        f"training {run_name}: {world.world_size} rank(s) on {world.device.type}, {precision}, "
        f"grad accumulation {grad_accum}, steps {start_step + 1}..{max_steps}"
    )


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


def _on_galaxy_clock(world: World, step: int, galaxy_step: int) -> int:
    """The galaxy step the trainer goes on from; said when it skips ahead (going back, after a held round or a
    take, the round's own warning says why)."""
    if galaxy_step > step:
        _say(world, f"catching up with the galaxy: inner step {step} -> {galaxy_step}")
    return galaxy_step


def _say(world: World, message: str) -> None:
    if world.is_main:
        print(message, flush=True)
