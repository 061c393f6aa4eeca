"""Health checks a node runs before it launches torchrun (``open-diloco preflight``).

A cluster that fails late fails expensively: every other node sits in the rendezvous until its timeout, and
the cause is buried in a traceback. So each thing a launch depends on is checked first, on its own, with a
timeout of a few seconds, and reported as one ``PASS``/``FAIL`` line that names the fix. Any failure stops
the launch before torchrun starts (``scripts/cluster_train.sh`` exits with preflight's status).
"""

from __future__ import annotations

import errno
import importlib
import platform
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from open_diloco.addresses import peer_address
from open_diloco.config import Config, check_against_world
from open_diloco.errors import ConfigError
from open_diloco.output_paths import ensure_run_outputs_writable

EXIT_FAILED = 1


class CheckFailed(Exception):
    """A check's verdict: ``str(self)`` says what is wrong, ``fix`` what to do about it."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.fix = fix


class Skipped(Exception):
    """A check that does not apply to this launch (e.g. DHT peers with the galaxy off)."""


@dataclass(frozen=True)
class Launch:
    """Where this node sits in its cluster, as ``cluster_train.sh`` will tell torchrun."""

    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    nproc_per_node: int = 1


@dataclass(frozen=True)
class Check:
    """One named check: ``run`` returns a PASS detail or raises :class:`CheckFailed` / :class:`Skipped`."""

    name: str
    run: Callable[[], str]
    timeout_s: float


def run_checks(checks: list[Check], out: Callable[[str], None] = print) -> bool:
    """Run every check (a failure does not hide the others), print one line each; True when none failed."""
    failed = 0
    for check in checks:
        status, detail = _run_with_timeout(check)
        failed += status == "FAIL"
        out(f"preflight: {status} {check.name:<11} {detail}")
    if failed:
        out(f"preflight: {failed} of {len(checks)} checks FAILED: fix the lines above; nothing was launched")
    else:
        out(f"preflight: all {len(checks)} checks passed")
    return not failed


def _run_with_timeout(check: Check) -> tuple[str, str]:
    """Run a check in a daemon thread so a hung resolver or socket cannot hang the launch."""
    outcome: list[tuple[str, str]] = []

    def target() -> None:
        try:
            outcome.append(("PASS", check.run()))
        except Skipped as skip:
            outcome.append(("SKIP", str(skip)))
        except CheckFailed as fail:
            outcome.append(("FAIL", f"{fail}; fix: {fail.fix}"))
        except Exception as err:  # an unexpected error is still a failed check, reported in one line
            outcome.append(("FAIL", f"{type(err).__name__}: {err}; fix: see the message"))

    thread = threading.Thread(target=target, name=f"preflight-{check.name}", daemon=True)
    thread.start()
    thread.join(check.timeout_s)
    if not outcome:
        return (
            "FAIL",
            f"no answer within {check.timeout_s:g} s; fix: see what hangs (network, filesystem, driver)",
        )
    return outcome[0]


def check_outputs(config: Config, launch: Launch) -> str:
    """What training will write can be written from this node: the checkpoint directory (every rank writes its
    shard) and, on node 0 (where the cluster's rank 0 runs), the jsonl metrics file."""
    try:
        ensure_run_outputs_writable(config, is_main=launch.node_rank == 0)
    except ConfigError as err:
        raise CheckFailed(str(err), "point the flag at a writable place, or fix its permissions") from None
    written = [f"checkpoints in {config.ckpt.path}"] if config.ckpt.interval is not None else []
    if launch.node_rank == 0 and config.metric_logger_type == "jsonl":
        written.append(f"metrics to {config.metrics_path}")
    return "can write " + ", ".join(written) if written else "nothing to write"


def build_checks(
    load_config: Callable[[], Config], launch: Launch, timeout_s: float = 5.0, master_wait_s: float = 60.0
) -> list[Check]:
    """The checks of one node's launch, in the order a person would debug them."""
    state: dict[str, Config] = {}

    def config_check() -> str:
        try:
            config = load_config()
            check_against_world(config, launch.num_nodes * launch.nproc_per_node)
        except ConfigError as err:
            raise CheckFailed(str(err), "correct the config file or the flag named") from None
        if not (config.path_model / "config.json").is_file():
            raise CheckFailed(
                f"--path-model {config.path_model} has no config.json (seen from {Path.cwd()})",
                "run from the directory the config's relative paths start at, or make path_model absolute",
            )
        state["config"] = config
        galaxy = "galaxy off"
        if config.hv is not None:
            hv = config.hv
            fixed = f"galaxy rank {hv.world_rank}/{hv.galaxy_size}"
            elastic = hv.unranked or hv.elastic  # (no rank given, or an id given)
            galaxy = f"elastic galaxy, first round of {hv.galaxy_size}" if elastic else fixed
        return f"{config.max_steps} steps, {launch.num_nodes * launch.nproc_per_node} rank(s), {galaxy}"

    def needs_config() -> Config:
        if "config" not in state:
            raise Skipped("needs a valid config")
        return state["config"]

    return [
        Check("config", config_check, timeout_s),
        # Importing torch from a cold network filesystem can take tens of seconds: not a failure.
        Check(
            "python",
            lambda: check_python("config" in state and state["config"].hv is not None),
            max(60.0, timeout_s),
        ),
        Check("outputs", lambda: check_outputs(needs_config(), launch), timeout_s),
        Check("devices", lambda: check_devices(needs_config(), launch.nproc_per_node), max(30.0, timeout_s)),
        Check(
            "master", lambda: check_master(launch, timeout_s, master_wait_s), master_wait_s + 2 * timeout_s
        ),
        Check("dht-peers", lambda: check_dht_peers(needs_config(), timeout_s), 2 * timeout_s + 1),
        Check("distributed", lambda: check_distributed(needs_config()), max(30.0, timeout_s)),
    ]


def check_python(with_hivemind: bool) -> str:
    """The interpreter imports what the trainer imports, and torchrun is on PATH."""
    modules = ["torch", "transformers", "pydantic", "cyclopts"] + (["hivemind"] if with_hivemind else [])
    versions = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # ImportError, or a broken native library raising something else
            raise CheckFailed(
                f"{sys.executable} cannot import {name} ({type(err).__name__}: {err})",
                "activate the right environment (VENV=... or CONDA_ENV=...) and `pip install -e .`",
            ) from None
        versions.append(f"{name} {getattr(module, '__version__', '?')}")
    if shutil.which("torchrun") is None:
        raise CheckFailed("torchrun is not on PATH", "activate the environment torch is installed in")
    return f"python {platform.python_version()}, " + ", ".join(versions)


def check_devices(config: Config, nproc_per_node: int) -> str:
    """The device and backend the trainer will choose exist for every local rank."""
    import torch

    from open_diloco.world import choose_backend, choose_device

    wants_cuda = config.device == "cuda" or config.backend == "nccl"
    try:
        device = choose_device("cuda" if wants_cuda else config.device, nproc_per_node - 1)
        backend = choose_backend(config.backend, device)
    except ConfigError as err:
        raise CheckFailed(
            str(err), "set BACKEND=gloo for CPU, or NPROC_PER_NODE to at most the GPUs visible"
        ) from None
    if device.type == "cuda":
        return (
            f"{torch.cuda.device_count()} GPU(s) visible for "
            f"{nproc_per_node} local rank(s), backend {backend}"
        )
    return f"cpu, backend {backend}, {nproc_per_node} local rank(s)"


def check_master(launch: Launch, timeout_s: float, master_wait_s: float) -> str:
    """Node 0 can listen on the master port; other nodes can reach it (waiting for node 0 to come up)."""
    where = f"{launch.master_addr}:{launch.master_port}"
    if launch.node_rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # torch's TCPStore sets SO_REUSEADDR too, so a port in TIME_WAIT is not "in use" to it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((_resolve(launch.master_addr), launch.master_port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise CheckFailed(
                        f"port {where} is already in use on this node",
                        "pick another master_port (and pass it to every node)",
                    ) from None
                raise CheckFailed(
                    f"cannot listen on {where} ({err.strerror})",
                    "node_rank 0 must run on the host master_addr names",
                ) from None
        return f"node 0 of {launch.num_nodes}: {where} free to host the rendezvous"
    address = _resolve(launch.master_addr)
    deadline = time.monotonic() + master_wait_s
    while True:  # nodes start together; node 0 runs its own preflight before it listens
        try:
            with socket.create_connection((address, launch.master_port), timeout=timeout_s):
                return f"node {launch.node_rank} of {launch.num_nodes}: reached rendezvous at {where}"
        except OSError as err:
            reason = err.strerror or type(err).__name__
            if time.monotonic() + 0.5 > deadline:
                raise CheckFailed(
                    f"cannot reach the master at {where} within {master_wait_s:g} s ({reason})",
                    "start node_rank 0 first (or together), check master_addr/master_port and the firewall; "
                    "MASTER_WAIT sets how long to wait",
                ) from None
            time.sleep(0.5)


def parse_multiaddr(maddr: str) -> tuple[str, int]:
    """Host and TCP port of a hivemind multiaddr such as ``/ip4/10.0.0.1/tcp/31337/p2p/Qm...``."""
    try:
        return peer_address(maddr)
    except ConfigError:
        raise CheckFailed(
            f"initial peer {maddr!r} is not a /ip4|ip6|dns/HOST/tcp/PORT/p2p/PEER_ID multiaddr",
            "copy the full line `hivemind-dht` prints (it ends in /p2p/<peer id>)",
        ) from None


def check_dht_peers(config: Config, timeout_s: float) -> str:
    """Every DHT initial peer accepts a TCP connection (the cheap part of joining the galaxy)."""
    if config.hv is None:
        raise Skipped("galaxy off (no --hv.* settings)")
    if not config.hv.initial_peers:
        return "no initial peers: this cluster starts the galaxy's DHT"
    for maddr in config.hv.initial_peers:
        host, port = parse_multiaddr(maddr)
        try:
            with socket.create_connection((_resolve(host), port), timeout=timeout_s):
                pass
        except OSError as err:
            raise CheckFailed(
                f"DHT peer {host}:{port} unreachable ({err.strerror or type(err).__name__})",
                "start hivemind-dht first, copy its current multiaddr into --hv.initial-peers, check the "
                "firewall",
            ) from None
    return f"{len(config.hv.initial_peers)} initial peer(s) accept connections"


def check_distributed(config: Config) -> str:
    """A one-rank process group of the backend the trainer will use forms and all-reduces (gloo needs a
    resolvable hostname and a usable interface, nccl a working driver): a broken stack fails here, alone,
    instead of inside a rendezvous of many nodes."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from open_diloco.world import choose_backend, choose_device

    device = choose_device(config.device, 0)
    backend = choose_backend(config.backend, device)
    if dist.is_initialized():
        raise CheckFailed(
            "a process group already exists in this process", "run preflight in its own process"
        )
    try:
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=10),
            device_id=device if device.type == "cuda" else None,
        )
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
    except Exception as err:  # gloo/nccl raise RuntimeError, DistBackendError, ...: all mean "broken stack"
        raise CheckFailed(
            f"{backend} cannot form a process group ({str(err).splitlines()[0]})",
            "check GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME and that the hostname resolves",
        ) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return f"1-rank {backend} group on {device.type}: init and all-reduce ok"


def _resolve(host: str) -> str:
    """Resolve a host name to an address, failing as a check (not a traceback) when DNS does not know it.
    (A resolver that hangs is caught by the check's timeout.)"""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        raise CheckFailed(
            f"host {host!r} does not resolve", "use an IP address or a name every node resolves"
        ) from None
