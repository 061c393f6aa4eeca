"""The training loop of one cluster. Reads top to bottom: set up, then inner steps, with an outer step
(DiLoCo) every ``--hv.local-steps`` when a galaxy is configured."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from open_diloco import checkpoint
from open_diloco.config import Config, HvConfig, check_against_world
from open_diloco.data import build_eval_loader, build_train_loader, plan_data
from open_diloco.errors import ConfigError, Stop
from open_diloco.logs import log_from_every_rank
from open_diloco.metrics import build_metrics
from open_diloco.model import build_model, load_model_config
from open_diloco.optim import build_inner_optimizer, build_scheduler, move_scheduler_to
from open_diloco.outer.cluster import ClusterComm
from open_diloco.outer.codecs import codec_label
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.protocols import NullOuterLoop, OuterLoop
from open_diloco.outer.state import local_shards
from open_diloco.outer.streaming import fragment_length
from open_diloco.output_paths import ensure_run_outputs_writable
from open_diloco.parallelize import parallelize, resolve_precision
from open_diloco.shutdown import StopGuard
from open_diloco.world import (
    World,
    describe_world,
    env_flag,
    join_process_group,
    leave_process_group,
    process_group_timeout,
)

log = logging.getLogger(__name__)


def train(config: Config) -> None:
    """Train one cluster according to ``config``. Every check a user can fail runs before ranks talk."""
    world = describe_world(config.device, config.backend)
    grad_accum = check_against_world(config, world.world_size)
    precision = resolve_precision(config.precision, world.device)
    model_config = load_model_config(config.path_model).to_dict()
    vocab_size = model_config["vocab_size"]
    resume = checkpoint.resolve_resume(config.ckpt, model_config)
    galaxy_rank, galaxy_size = (config.hv.world_rank, config.hv.galaxy_size) if config.hv else (0, 1)
    log_from_every_rank(galaxy_rank, world.rank, world.local_rank, env_flag("LOG_LEVEL"))
    data = plan_data(config, vocab_size, world.world_size, galaxy_rank, galaxy_size)
    run_name = config.run_name or f"cluster{galaxy_rank}-{time.strftime('%Y%m%d-%H%M%S')}"
    ensure_run_outputs_writable(config, world.is_main)

    guard = StopGuard().install()
    join_process_group(world, process_group_timeout(config.hv))
    metrics = build_metrics(
        config.metric_logger_type,
        world.is_main,
        config.metrics_path,
        config.project,
        run_name,
        config.model_dump(mode="json"),
    )
    outer: OuterLoop = NullOuterLoop()
    saver = checkpoint.CheckpointSaver(
        config.ckpt.path, config.ckpt.keep, config.model_dump(mode="json"), model_config
    )
    ending = "stopped"  # how the run ended, for the status board
    try:
        model = build_model(config.path_model, config.seed)
        model = parallelize(
            model, world.device, precision, config.activation_checkpointing, config.torch_compile
        )
        outer = build_outer_loop(config.hv, model, world)
        optimizer = build_inner_optimizer(model, config.lr, config.weight_decay, config.adam_betas)
        scheduler = build_scheduler(
            optimizer, config.warmup_steps, config.schedule_steps, config.min_lr_ratio
        )
        batch_args = dict(
            per_device_batch=config.per_device_train_batch_size, rank=world.rank, world_size=world.world_size
        )
        loader = build_train_loader(data, **batch_args, num_workers=config.num_workers)
        eval_loader = build_eval_loader(data, **batch_args, steps=config.eval_steps)
        start_step = 0
        if resume is not None:
            start_step = checkpoint.load(*resume, model=model, optimizer=optimizer, outer=outer)
            _say(world, f"resumed from {resume[0]} at step {start_step}")
        start_step = max(start_step, outer.join_galaxy())
        batches = position_at(start_step, loader, scheduler, grad_accum)
        tokens_per_step = config.total_batch_size * config.seq_length
        _say(
            world,
            f"training {run_name}: {world.world_size} rank(s) on {world.device.type}, {precision}, "
            f"grad accumulation {grad_accum}, steps {start_step + 1}..{config.max_steps}",
        )

        step = start_step
        while step < config.max_steps:
            step += 1
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
            syncs = outer.syncs_after_inner_step(step, last=step == config.max_steps)
            for earlier in syncs[:-1]:  # two syncs ended at this step (--hv.sync-delay = H/P): a line for each
                metrics.log({**record, **earlier.metrics()})
            record.update(syncs[-1].metrics() if syncs else {})
            if any(sync.diverged for sync in syncs):
                optimizer.state.clear()  # diverged: the weights came back from the galaxy, AdamW's moments start afresh
            galaxy_step = outer.inner_step_of_galaxy()
            if galaxy_step > step:  # this cluster adopted a more advanced cluster's state: catch up
                _say(world, f"catching up with the galaxy: inner step {step} -> {galaxy_step}")
                step = galaxy_step
                batches = position_at(step, loader, scheduler, grad_accum)
            if config.eval_interval and (step % config.eval_interval == 0 or step == config.max_steps):
                record["val_loss"] = evaluate(model, eval_loader, world)
            metrics.log(record)
            outer.report(record)
            if step % config.log_interval == 0 or step == config.max_steps:
                _say(world, format_step_line(record, config.max_steps))
            if config.ckpt.interval and step % config.ckpt.interval == 0:
                saver.start(step, model=model, optimizer=optimizer, outer=outer)  # written in the background
        saver.wait()  # the run's last checkpoint is complete before the run counts as finished
        ending = "finished"
    except Stop as stop:
        _say(world, f"stopping: {stop.reason}")
        ending = f"stopped ({stop.reason})"
        raise SystemExit(stop.exit_code) from None
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        ending = f"failed ({first_line[:200]})"
        if not isinstance(err, ConfigError):  # a user error is already one line on every rank, from cli/app.py
            log.error("training stopped: %s", first_line)  # when and on which rank; the traceback follows
        raise
    finally:
        guard.begin_shutdown()
        saver.close(timeout=checkpoint.SAVE_GRACE_SECONDS)  # a stopped run: bounded wait, then abandon
        outer.report({"state": ending})
        outer.close()
        metrics.close()
        leave_process_group(synchronize=ending == "finished")


def position_at(step: int, loader: Any, scheduler: Any, grad_accum: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches and learning rate for continuing after inner step ``step``. Both are pure functions of the
    step, which is what makes resume, late join and catching up with the galaxy the same operation."""
    loader.sampler.next_block = step * grad_accum
    move_scheduler_to(scheduler, step)
    return iter(loader)


def build_outer_loop(hv: HvConfig | None, model: torch.nn.Module, world: World) -> OuterLoop:
    """DiLoCo over hivemind when a galaxy is configured, else the no-op loop.

    Each local rank averages its own FSDP shard with the same shard of every other cluster. When no
    initial peers are given, rank 0's DHT is the entry point and the other ranks join it.
    """
    if hv is None:
        return NullOuterLoop()
    from open_diloco.galaxy.allowlist import Allowlist, ensure_identity, rank_key_file
    from open_diloco.galaxy.averager import start_shard_averager  # hivemind, loaded only when needed

    allowlist = Allowlist.load(hv.allowlist) if hv.allowlist is not None else None
    identity_path = None
    if hv.identity_path is not None:  # the shard index names the key: one PeerID per shard, stable across runs
        peer_id = ensure_identity(hv.identity_path, world.rank)
        identity_path = str(rank_key_file(hv.identity_path, world.rank))
        log.info("rank %d: PeerID %s (%s)", world.rank, peer_id, identity_path)
        if allowlist is not None and not allowlist.admits(peer_id):
            log.warning("this rank's PeerID %s is not on --hv.allowlist %s: the other clusters' lists must name it",
                        peer_id, hv.allowlist)

    def start(initial_peers: list[str]):
        return start_shard_averager(
            initial_peers=initial_peers,
            host_maddrs=hv.host_maddrs,
            announce_maddrs=hv.announce_maddrs,
            run_id=hv.run_id,
            shard_index=world.rank,
            numel=fragment_length(sum(shard.numel() for shard in local_shards(model)), hv.fragments),
            galaxy_rank=hv.world_rank,
            galaxy_size=hv.galaxy_size,
            matchmaking_time=hv.matchmaking_time,
            averaging_timeout=hv.averaging_timeout,
            join_timeout=hv.join_timeout,
            compression=hv.compression,
            sparse_rule=hv.sparse_rule,
            member_expiry=hv.member_expiry,
            schema=schema,
            delta_norm_bound=hv.delta_norm_bound,
            robust_mean=hv.robust_mean,
            identity_path=identity_path,
            allowlist=allowlist,
        )

    schema = {"model_fingerprint": model_fingerprint(model), "ranks": world.world_size,
              "codec": codec_label(hv.compression, hv.sparse_density, hv.sparse_rule), "fragments": hv.fragments}
    cluster = ClusterComm(world.device)
    if hv.initial_peers or world.world_size == 1:
        averager = start(hv.initial_peers)
    else:
        entry: list[list[str]] = [[]]
        averager = start([]) if world.rank == 0 else None
        if averager is not None:
            entry = [averager.visible_maddrs]
        dist.broadcast_object_list(entry, src=0)
        averager = averager or start(entry[0])
    try:
        outer_log = logging.getLogger("open_diloco.outer")
        shard_peer_ids = cluster.gather_strings(averager.peer_id)
        status = _status_board(hv, averager, schema, shard_peer_ids) if world.rank == 0 else None
        return DiLoCo(model, averager, hv, cluster=cluster, warn=outer_log.warning, status=status)
    except BaseException:
        averager.shutdown()  # the trainer's `finally` only knows the outer loop, which does not exist yet
        raise


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's parameter names and (global) shapes: clusters with different ones cannot
    average together."""
    import xxhash

    layout = ";".join(f"{name}:{tuple(param.shape)}" for name, param in model.named_parameters())
    return xxhash.xxh3_64(layout.encode()).hexdigest()


def _status_board(hv: HvConfig, averager: Any, schema: dict[str, Any], shard_peer_ids: list[str]) -> Any:
    """This cluster's membership and status record (``open-diloco status``), kept by rank 0."""
    from open_diloco import version_line
    from open_diloco.galaxy.status import StatusPublisher, cluster_identity

    identity = cluster_identity(hv.world_rank, schema, hv.local_steps, version_line(), shard_peer_ids)
    return StatusPublisher(averager.dht, hv.run_id, identity, hv.heartbeat_interval, hv.member_expiry)


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
    """Peak memory of this rank so far (`memory_gib`, docs/configuration.md): the CUDA allocator's peak on a
    GPU, the process's peak resident set (ru_maxrss, KiB on Linux) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _say(world: World, message: str) -> None:
    if world.is_main:
        print(message, flush=True)
