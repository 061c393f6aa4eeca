"""Launcher detection: which ranks a process believes it has, from torchrun, SLURM or PBS variables alone."""

import pytest
import torch

from open_diloco.config import HvConfig
from open_diloco.errors import ConfigError
from open_diloco.world import (
    World,
    default_master_addr,
    expand_slurm_nodelist,
    expand_slurm_tasks_per_node,
    launcher_env,
    process_group_timeout,
)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
# What srun gives task 5 of `srun -N 3 -n 6` (2 tasks per node) on node[01-03] (names checked against
# Slurm 22.05's srun).
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "6",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NNODES": "3",
    "SLURM_NODELIST": "node[01-03]",
    "SLURM_TASKS_PER_NODE": "2(x3)",
    "SLURM_STEP_ID": "0",
}
# What an sbatch script's own shell sees for `sbatch -N 3 -n 6`: one process, whatever SLURM_NTASKS says.
SLURM_BATCH_SHELL = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "6",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NODELIST": "node[01-03]",
    "SLURM_TASKS_PER_NODE": "2(x3)",
}
PBS = {"PBS_JOBID": "123.pbs", "PMI_RANK": "2", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "2"}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5", ["gpu5"]),
        ("a,b", ["a", "b"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("", []),
    ],
)
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


def test_expand_slurm_tasks_per_node():
    assert expand_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_slurm_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError):
        expand_slurm_tasks_per_node("four")


def test_torchrun_wins_over_slurm_and_pbs():
    env = launcher_env({**PBS, **SLURM, **TORCHRUN})
    assert env == {"rank": 3, "world_size": 8, "local_rank": 1, "local_world_size": 2, "launcher": "torchrun"}


def test_slurm_wins_over_pbs():
    env = launcher_env({**PBS, **SLURM})
    assert env == {"rank": 5, "world_size": 6, "local_rank": 1, "local_world_size": 2, "launcher": "slurm"}


def test_slurm_uneven_nodes_use_this_nodes_count():
    env = launcher_env({**SLURM, "SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": "2(x2),3", "SLURM_PROCID": "6"})
    assert (env["world_size"], env["local_world_size"]) == (7, 3)


def test_slurm_step_variables_beat_job_variables():
    # A step using part of the allocation: the job has 8 tasks, this srun started 2 on one node.
    env = launcher_env(
        {
            **SLURM,
            "SLURM_NTASKS": "8",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_NODEID": "0",
            "SLURM_PROCID": "1",
        }
    )
    assert (env["world_size"], env["local_world_size"]) == (2, 2)


def test_slurm_without_task_list_falls_back_to_even_split():
    env = dict(SLURM)
    del env["SLURM_TASKS_PER_NODE"]
    assert launcher_env(env)["local_world_size"] == 2  # 6 tasks / 3 nodes


def test_slurm_batch_shell_is_a_single_process():
    assert launcher_env(SLURM_BATCH_SHELL)["launcher"] == "single"


def test_pbs_mpich_and_openmpi():
    assert launcher_env(PBS) == {
        "rank": 2,
        "world_size": 4,
        "local_rank": 0,
        "local_world_size": 2,
        "launcher": "pbs",
    }
    ompi = {
        "PBS_JOBID": "1",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert launcher_env(ompi) == {
        "rank": 1,
        "world_size": 2,
        "local_rank": 1,
        "local_world_size": 2,
        "launcher": "pbs",
    }


def test_pbs_without_mpi_ranks_is_a_single_process():
    # A PBS job script itself (no mpiexec) is one process, whatever the allocation.
    assert launcher_env({"PBS_JOBID": "1"})["launcher"] == "single"


def test_nothing_set_is_a_single_process():
    assert launcher_env({}) == {
        "rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "local_world_size": 1,
        "launcher": "single",
    }


def _world(world_size: int, local_world_size: int) -> World:
    return World(0, world_size, 0, local_world_size, torch.device("cpu"), "gloo")


def test_default_master_addr():
    assert default_master_addr("slurm", _world(6, 2), SLURM) == "node01"
    assert default_master_addr("slurm", _world(6, 2), {**SLURM, "SLURM_STEP_NODELIST": "gpu[7-9]"}) == "gpu7"
    assert default_master_addr("pbs", _world(2, 2), PBS) == "127.0.0.1"
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        default_master_addr("pbs", _world(4, 2), PBS)


def test_the_process_group_timeout_covers_the_longest_wait_of_a_round():
    assert process_group_timeout(None) == 600.0  # no galaxy: torch's own default, as before
    # defaults: 3 attempts x (buffer lock 121 s + all-reduce 120 s) + a 60 s re-sync + 2 s gathering = 785 s,
    # + the last round's wait for silent clusters (--hv.final-wait, 120 s), x 1.5
    assert process_group_timeout(HvConfig()) == pytest.approx(1.5 * (785.0 + 120.0))
    slow_link = HvConfig(
        averaging_timeout=900.0, max_retries=0, join_timeout=600.0, final_wait=0.0
    )  # a 7B int8 round at 100 Mbit/s
    assert process_group_timeout(slow_link) == pytest.approx(1.5 * (1801.0 + 600.0 + 2.0))
    assert process_group_timeout(HvConfig(final_wait=600.0)) == pytest.approx(1.5 * (785.0 + 600.0))
    assert (
        process_group_timeout(HvConfig(averaging_timeout=8.0, join_timeout=5.0)) == 600.0
    )  # never below the floor
    assert process_group_timeout(
        HvConfig(
            averaging_timeout=2.0, max_retries=0, join_timeout=1.0, matchmaking_time=0.5, final_wait=0.0
        ),
        floor=1.0,
    ) == pytest.approx(9.75)
