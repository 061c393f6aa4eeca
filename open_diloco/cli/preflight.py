"""``open-diloco preflight [OPTIONS] -- TRAINER_FLAGS``: check that this node can launch its part of a
cluster."""

from __future__ import annotations

import sys
from typing import Annotated

import cyclopts
import pydantic
from cyclopts import Parameter, validators

from open_diloco.cli.app import describe_error, is_training, parse
from open_diloco.config import Config
from open_diloco.errors import ConfigError


def preflight(
    *trainer_args: str,
    num_nodes: Annotated[int, Parameter(validator=validators.Number(gte=1))] = 1,
    node_rank: Annotated[int, Parameter(validator=validators.Number(gte=0))] = 0,
    master_addr: str = "127.0.0.1",
    master_port: Annotated[int, Parameter(validator=validators.Number(gte=1, lte=65535))] = 29500,
    nproc_per_node: Annotated[int, Parameter(validator=validators.Number(gte=1))] = 1,
    timeout: Annotated[float, Parameter(validator=validators.Number(gt=0))] = 5.0,
    master_wait: Annotated[float, Parameter(validator=validators.Number(gte=0))] = 60.0,
) -> None:
    """Check that this node can launch its part of a cluster: one PASS/FAIL line per check, exit 1 on a
    failure.

    Usage: open-diloco preflight [OPTIONS] -- TRAINER_FLAGS, where TRAINER_FLAGS are the flags torchrun will
    give the trainer (e.g. --config configs/demo-2m.toml --hv.initial-peers ...). scripts/cluster_train.sh
    runs this before it starts torchrun.

    Parameters
    ----------
    trainer_args
        The trainer's flags, after `--`.
    num_nodes
        Nodes in this cluster. [range: ≥ 1]
    node_rank
        This node's rank (0 hosts the rendezvous; the others must reach it). [range: 0 ≤ x < num-nodes]
    master_addr
        Host of node_rank 0.
    master_port
        Rendezvous port on master_addr. [range: 1 ≤ x ≤ 65535]
    nproc_per_node
        Ranks this node will start. [range: ≥ 1]
    timeout
        Seconds each network check may take. [range: > 0]
    master_wait
        Seconds a node_rank > 0 waits for the master to listen (nodes start together and node 0 runs its own
        preflight first). [range: ≥ 0]
    """
    from open_diloco.preflight import EXIT_FAILED, Launch, build_checks, run_checks

    if node_rank >= num_nodes:
        raise ConfigError(
            f"--node-rank {node_rank} is not below --num-nodes {num_nodes}: use 0..{num_nodes - 1}"
        )
    launch = Launch(num_nodes, node_rank, master_addr, master_port, nproc_per_node)

    def load_config() -> Config:
        try:
            command, bound = parse(trainer_args)
        except (pydantic.ValidationError, cyclopts.CycloptsError) as err:
            raise ConfigError(describe_error(err)) from None
        if not is_training(command):
            raise ConfigError(
                f"expected the trainer's flags after `--`, got the subcommand {trainer_args[0]!r}"
            )
        return bound.arguments.get("config") or Config()

    if not run_checks(
        build_checks(load_config, launch, timeout, master_wait), lambda line: print(line, flush=True)
    ):
        sys.exit(EXIT_FAILED)
