"""Where this process stands: its ranks, its device, its backend.

This is the only module that reads launcher environment variables (torchrun; SLURM and PBS when a job
starts ranks without torchrun), so every other module asks a :class:`World` instead of ``os.environ``.
"""

from __future__ import annotations

import atexit
import gc
import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from open_diloco.config import HvConfig
from open_diloco.errors import ConfigError


@dataclass(frozen=True)
class World:
    """Ranks of this process inside its cluster (one torchrun job) and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    restarts: int = 0
    """How many times torchrun restarted this cluster's ranks so far (``--max-restarts``; 0 on the first
    start): a restarted cluster says so in its log and its metrics' start record."""

    @property
    def is_main(self) -> bool:
        """Rank 0 of the cluster: the one that prints and logs metrics."""
        return self.rank == 0


def launcher_env(env: dict[str, str] | None = None) -> dict[str, int | str]:
    """Ranks from torchrun's variables, else SLURM's, else PBS's (MPI launchers), else a single process.

    Returns ``rank``, ``world_size``, ``local_rank``, ``local_world_size`` and ``launcher``. torchrun wins
    because our launchers run torchrun *inside* a SLURM or PBS allocation, where both sets are present.
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
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_STEP_ID" in env):
        # Only srun-started tasks count: an sbatch script's own shell also has SLURM_PROCID=0 and
        # SLURM_NTASKS=<whole job>, yet it is one process, and believing the job size would hang the
        # rendezvous. srun's SLURM_STEP_* names describe the step, which may use part of the allocation.
        ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
        return {
            "rank": int(env["SLURM_PROCID"]),
            "world_size": ntasks,
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "local_world_size": _slurm_tasks_on_this_node(env, ntasks),
            "launcher": "slurm",
        }
    if "PBS_JOBID" in env and ("PMI_RANK" in env or "OMPI_COMM_WORLD_RANK" in env):
        # PBS starts no ranks itself: mpiexec does (MPICH/Cray PALS: PMI_*, Intel MPI: MPI_LOCAL*, Open MPI:
        # OMPI_*).
        rank = int(_first(env, "PMI_RANK", "OMPI_COMM_WORLD_RANK", default="0"))
        size = int(_first(env, "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", default="1"))
        return {
            "rank": rank,
            "world_size": size,
            "local_rank": int(
                _first(
                    env,
                    "PMI_LOCAL_RANK",
                    "PALS_LOCAL_RANKID",
                    "MPI_LOCALRANKID",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    default="0",
                )
            ),
            "local_world_size": int(
                _first(
                    env,
                    "PMI_LOCAL_SIZE",
                    "PALS_LOCAL_SIZE",
                    "MPI_LOCALNRANKS",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                    default=str(size),
                )
            ),
            "launcher": "pbs",
        }
    return {"rank": 0, "world_size": 1, "local_rank": 0, "local_world_size": 1, "launcher": "single"}


def _first(env: dict[str, str], *names: str, default: str) -> str:
    return next((env[name] for name in names if env.get(name, "") != ""), default)


def _slurm_tasks_on_this_node(env: dict[str, str], ntasks: int) -> int:
    """Tasks on this node: this node's entry of SLURM's ``2(x3),1`` task list, which, unlike
    SLURM_NTASKS_PER_NODE (set only when the user asked for it), is always set and also covers uneven
    nodes."""
    per_node = expand_slurm_tasks_per_node(
        _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", default="")
    )
    node_id = int(env.get("SLURM_NODEID", 0))
    if node_id < len(per_node):
        return per_node[node_id]
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    nnodes = int(env.get("SLURM_NNODES", 0)) or len(expand_slurm_nodelist(slurm_nodelist(env))) or 1
    return max(1, ntasks // nnodes)


def slurm_nodelist(env: dict[str, str] | None = None) -> str:
    """The compressed host list of this job step (srun) or, outside a step, of the job."""
    env = dict(os.environ) if env is None else env
    return _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", default="")


def expand_slurm_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's task counts per node (``2(x3),1`` means 2, 2, 2, 1)."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ConfigError(f"cannot read SLURM tasks-per-node {spec!r}: expected e.g. 2(x3),1")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list (``node[01-03,07],gpu5``, ``rack[1-2]-n[1-2]``) into host names,
    in SLURM's order (the first host is where rank 0 runs)."""
    hosts: list[str] = []
    for name in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_brackets(name))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Split at commas outside brackets."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(nodelist[start:i])
            start = i + 1
    names.append(nodelist[start:])
    return [name for name in names if name]


def _expand_brackets(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    expanded: list[str] = []
    for part in match[1].split(","):
        lo, _, hi = part.partition("-")
        numbers = [lo] if not hi else [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
        for number in numbers:
            expanded.extend(_expand_brackets(head + number + tail))
    return expanded


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
        restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
    )


PROCESS_GROUP_FLOOR_SECONDS = 600.0
"""The least a collective may wait for a sibling rank (the fixed timeout of old): a rank also waits outside
rounds (a checkpoint write, a slow data read) and those waits have no flag to derive from."""
PROCESS_GROUP_MARGIN = 1.5
"""Over the longest wait a round's flags allow: the round's own work (outer step, hashes, membership
reads)."""
BUFFER_LOCK_GRACE_SECONDS = 1.0
"""What a rank waits for its averager's buffer lock beyond ``--hv.averaging-timeout``
(``galaxy/averager.py``)."""


def process_group_timeout(hv: HvConfig | None, floor: float = PROCESS_GROUP_FLOOR_SECONDS) -> float:
    """Seconds a collective of the cluster waits for a sibling rank before the cluster dies: at least
    ``floor``, and the margin over the longest wait the galaxy flags allow one rank in one round while its
    siblings sit in a collective. Why: the ranks of a cluster average their shards each on their own, so one
    rank can wait on the network far longer than another; a fixed timeout below that (it was 600 s) killed a
    healthy cluster whose link is slow (a 7B int8 round at 100 Mbit/s takes ~10 min). Each attempt of a round
    (1 + ``--hv.max-retries``) waits for the buffer lock (``--hv.averaging-timeout`` + 1 s) and then for the
    all-reduce (``--hv.averaging-timeout``, matchmaking included); a re-sync downloads for up to
    ``--hv.join-timeout``, and a round may gather once more (``--hv.matchmaking-time``); the last round waits
    ``--hv.final-wait`` for silent clusters (``CatchUp.settle_final``). A wait added to a
    round must be added here. ``floor`` is a parameter for tests only (a short stand-in for 600 s): no flag,
    since raising the round's own flags raises this with them and a separate one could only fall out of
    step."""
    if hv is None:
        return floor
    attempt = hv.averaging_timeout + BUFFER_LOCK_GRACE_SECONDS + hv.averaging_timeout
    round_wait = (1 + hv.max_retries) * attempt + hv.join_timeout + hv.matchmaking_time
    round_wait += hv.final_wait  # the last round: a rank done waiting for silent clusters waits in a gather
    return max(floor, PROCESS_GROUP_MARGIN * round_wait)


def join_process_group(world: World, timeout_s: float = PROCESS_GROUP_FLOOR_SECONDS) -> None:
    """Form the cluster's process group, whose collectives wait ``timeout_s`` for a late rank (see
    :func:`process_group_timeout`). A single process gets a one-rank group over an in-memory store, so FSDP2
    and collectives run the same code path with one rank as with many."""
    if dist.is_initialized():
        return
    atexit.unregister(_release_device_meshes)  # once, however often a process joins
    atexit.register(_release_device_meshes)
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    timeout = timedelta(seconds=timeout_s)
    if world.world_size == 1:
        dist.init_process_group(world.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    launcher = launcher_env()["launcher"]
    if launcher in ("slurm", "pbs"):
        # torch.distributed's env:// rendezvous reads torchrun's names; SLURM/PBS gave us their own.
        os.environ.setdefault("RANK", str(world.rank))
        os.environ.setdefault("WORLD_SIZE", str(world.world_size))
        os.environ.setdefault("LOCAL_RANK", str(world.local_rank))
        os.environ.setdefault("MASTER_ADDR", default_master_addr(launcher, world))
        os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        world.backend,
        timeout=timeout,
        device_id=world.device if world.device.type == "cuda" else None,
        **restart_safe_store(world, timeout),
    )


def restart_safe_store(world: World, timeout: timedelta) -> dict[str, object]:
    """Under a torchrun that restarted the cluster (``--max-restarts``), the process group's store, with keys
    of their own for this restart; otherwise nothing (torch's env:// rendezvous).

    Why: torchrun's agent hosts one store for every restart, and torch 2.13's env:// rendezvous no longer
    prefixes its keys per restart ("a new TCPStore for every retry", its comment says, but the agent's is
    reused), so restarted gloo ranks read the dead ranks' addresses and fail to connect ("connectFullMesh
    failed ... Connection refused"; reproduced with a 10-line gloo script). A prefix per restart count keeps
    each restart's keys apart."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not world.restarts:
        return {}
    agent_store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world.world_size, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"/open_diloco/restart_{world.restarts}", agent_store)
    return {"store": store, "rank": world.rank, "world_size": world.world_size}


def default_master_addr(launcher: str, world: World, env: dict[str, str] | None = None) -> str:
    """Where rank 0 listens when the launcher set no MASTER_ADDR: SLURM's first host (rank 0 runs there), or
    this host when every rank is on it. A multi-node PBS/MPI launch must say where: guessing 127.0.0.1 would
    leave the other nodes waiting on themselves."""
    env = dict(os.environ) if env is None else env
    if launcher == "slurm":
        hosts = expand_slurm_nodelist(slurm_nodelist(env))
        if hosts:
            return hosts[0]
    if world.world_size <= world.local_world_size:
        return "127.0.0.1"
    raise ConfigError(
        f"{world.world_size} ranks over several nodes but MASTER_ADDR is not set: export MASTER_ADDR=<host "
        "of rank 0> (e.g. the first line of $PBS_NODEFILE), or launch with scripts/cluster_train.sh"
    )


TEARDOWN_SECONDS = 30.0  # how long a finished rank waits for the others to be done with gloo/nccl


def leave_process_group(synchronize: bool = False) -> None:
    """Tear the process group down (idempotent). ``synchronize`` (a clean finish): first make sure no rank
    still uses a connection that this one is about to close.

    A collective barrier alone is not enough: a rank returns from it once it has heard from everyone, while
    its own last messages may still be on their way, and closing its pairs then kills the slower peer's gloo
    thread ("terminate called without an active exception", SIGABRT, about once in a few hundred runs). So
    each rank also checks in through the launcher's key-value store, which is not one of those connections,
    and destroys the group only when every rank has finished the barrier."""
    if not dist.is_initialized():
        return
    if synchronize and dist.get_world_size() > 1:
        dist.barrier()
        _store_barrier("open_diloco/teardown", dist.get_world_size())
    dist.destroy_process_group()


def _release_device_meshes() -> None:
    """Free the process group while the interpreter is whole, not during its teardown.

    ``destroy_process_group`` unregisters the group, but DTensor keeps module-level caches (sharding
    propagation, redistribution plans, mesh topology) whose entries hold the device mesh, and the mesh holds
    the group. So the gloo backend and its worker threads lived on into interpreter finalization, where a
    worker thread that let go of a tensor could not take the GIL and aborted the process after a clean run
    ("terminate called without an active exception", SIGABRT: a 1-rank probe in CI). Registered as an exit
    hook by :func:`join_process_group`: at exit the trainer's model is unreachable, so emptying those caches
    and collecting FSDP's module cycles lets the group's destructor join its threads while Python still
    runs. The caches are private to torch: each is emptied only where this torch has it, and
    tests/dist/test_teardown.py watches the threads."""
    if dist.is_initialized():
        return  # the group is still in use
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    for owner, path in (
        (debug, "_clear_sharding_prop_cache"),
        (_redistribute, "clear_redistribute_planner_cache"),
        (_redistribute, "_gen_transform_infos.cache_clear"),
        (_collective_utils, "MeshTopoInfo.build_from_mesh.cache_clear"),
    ):
        clear = owner
        for name in path.split("."):
            clear = getattr(clear, name, None)
        if callable(clear):
            clear()
    gc.collect()  # FSDP's modules and hooks form cycles: the mesh is unreachable only once they are collected


def _store_barrier(key: str, world_size: int) -> None:
    store = dist.distributed_c10d._get_default_store()
    if store.add(key, 1) == world_size:
        store.set(f"{key}/done", "1")
    store.set_timeout(timedelta(seconds=TEARDOWN_SECONDS))
    try:
        store.wait([f"{key}/done"])
    except dist.DistStoreError:  # a peer died after the barrier: nothing left to protect, tear down anyway
        pass


def env_flag(name: str) -> str | None:
    """Read one environment variable (the single door other modules use, e.g. WANDB_MODE)."""
    return os.environ.get(name)
