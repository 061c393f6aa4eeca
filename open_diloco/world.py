"""Where this process stands: its ranks, its device, its backend.

This is the only module that reads launcher environment variables (torchrun; SLURM and PBS when a job
starts ranks without torchrun), so every other module asks a :class:`World` instead of ``os.environ``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from open_diloco.config import ConfigError


@dataclass(frozen=True)
class World:
    """Ranks of this process inside its cluster (one torchrun job) and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Rank 0 of the cluster: the one that prints and logs metrics."""
        return self.rank == 0


def launcher_env(env: dict[str, str] | None = None) -> dict[str, int | str]:
    """Ranks from torchrun's variables, else SLURM's, else PBS's, else a single process.

    Returns ``rank``, ``world_size``, ``local_rank``, ``local_world_size`` and ``launcher``.
    """
    env = dict(os.environ) if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            "launcher": "torchrun",
        }
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        ntasks = int(env["SLURM_NTASKS"])
        nnodes = int(env.get("SLURM_NNODES", len(expand_slurm_nodelist(env.get("SLURM_NODELIST", ""))) or 1))
        return {
            "rank": int(env["SLURM_PROCID"]),
            "world_size": ntasks,
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "local_world_size": int(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or ntasks // nnodes),
            "launcher": "slurm",
        }
    if "PBS_JOBID" in env and "PMI_RANK" in env:
        size = int(env.get("PMI_SIZE", 1))
        return {
            "rank": int(env["PMI_RANK"]),
            "world_size": size,
            "local_rank": int(env.get("PMI_LOCAL_RANK", env.get("MPI_LOCALRANKID", 0))),
            "local_world_size": int(env.get("PMI_LOCAL_SIZE", env.get("MPI_LOCALNRANKS", size))),
            "launcher": "pbs",
        }
    return {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "launcher": "single"}


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list (``node[01-03,07],gpu5``) into host names."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return hosts


def choose_device(requested: str, local_rank: int) -> torch.device:
    """CUDA when requested or available (one GPU per local rank), else CPU."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                "--device cuda but no CUDA GPU is visible: use --device cpu, or check CUDA_VISIBLE_DEVICES"
            )
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): "
                "lower --nproc_per_node to the number of GPUs"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def choose_backend(requested: str, device: torch.device) -> str:
    """nccl on CUDA, gloo on CPU; an explicit choice wins but must fit the device."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError("--backend nccl needs CUDA devices: use --backend gloo on CPU")
    return requested


def describe_world(device: str = "auto", backend: str = "auto") -> World:
    """Ranks, device and backend of this process, without any communication.

    Everything a user can get wrong is checked from this description *before* the process group forms, so a
    bad flag makes every rank exit on its own instead of leaving peers blocked in a rendezvous.
    """
    env = launcher_env()
    dev = choose_device(device, int(env["local_rank"]))
    return World(
        rank=int(env["rank"]),
        world_size=int(env["world_size"]),
        local_rank=int(env["local_rank"]),
        local_world_size=int(env["local_world_size"]),
        device=dev,
        backend=choose_backend(backend, dev),
    )


def join_process_group(world: World, timeout_s: float = 600.0) -> None:
    """Form the cluster's process group. A single process gets a one-rank group over an in-memory store, so
    FSDP2 and collectives run the same code path with one rank as with many."""
    if dist.is_initialized():
        return
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    timeout = timedelta(seconds=timeout_s)
    if world.world_size == 1:
        dist.init_process_group(world.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if launcher_env()["launcher"] in ("slurm", "pbs"):
        # torch.distributed's env:// rendezvous reads torchrun's names; SLURM/PBS gave us their own.
        os.environ.setdefault("RANK", str(world.rank))
        os.environ.setdefault("WORLD_SIZE", str(world.world_size))
        os.environ.setdefault("LOCAL_RANK", str(world.local_rank))
        if "MASTER_ADDR" not in os.environ:
            nodes = expand_slurm_nodelist(os.environ.get("SLURM_NODELIST", "")) or ["127.0.0.1"]
            os.environ["MASTER_ADDR"] = nodes[0]
        os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        world.backend, timeout=timeout, device_id=world.device if world.device.type == "cuda" else None
    )


def leave_process_group() -> None:
    """Tear the process group down (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def env_flag(name: str) -> str | None:
    """Read one environment variable (the single door other modules use, e.g. WANDB_MODE)."""
    return os.environ.get(name)
