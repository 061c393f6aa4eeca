"""scripts/cluster_train.sh end to end: two launches on 127.0.0.1 form one 2-node cluster and train."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from tests.conftest import free_port
from tests.ops.launch import SCRIPT, kill_tagged, launcher_env, tagged_pids, write_config

pytestmark = pytest.mark.dist


def test_two_launches_form_one_cluster_with_per_node_logs(tmp_path):
    config = write_config(tmp_path / "cluster.toml")
    port = str(free_port())
    env, torchrun_marker = launcher_env(tmp_path, MASTER_WAIT="60")
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [str(SCRIPT), str(config), "2", str(rank), "127.0.0.1", port, "--run-name", f"ops-test-{rank}"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    deadline, outputs = started + 170, []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        pass
    finally:
        left = kill_tagged(env["OPEN_DILOCO_TEST_TAG"])
    if len(outputs) < len(procs):  # timed out: show what each node said before it was killed
        outputs += [proc.communicate(timeout=30)[0] for proc in procs[len(outputs) :]]
        pytest.fail(
            "cluster_train.sh did not finish in 170 s:\n" + "\n----\n".join(o[-3000:] for o in outputs)
        )
    elapsed = time.monotonic() - started
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert not left, f"processes left behind: {left}"
    assert torchrun_marker.exists()

    log_dir = tmp_path / "logs" / "distributed_training"
    logs = {}
    for rank in (0, 1):
        latest = log_dir / f"cluster_train_latest_node{rank}.log"
        assert latest.is_symlink() and re.fullmatch(
            rf"cluster_train_\d{{8}}_\d{{6}}_node{rank}\.log", latest.readlink().name
        )
        logs[rank] = latest.read_text()
        assert logs[rank] in outputs[rank]  # the console shows what the log holds
        assert "preflight: all 7 checks passed" in logs[rank]
        assert "torchrun exited with status 0" in logs[rank]
    # One cluster of 2 ranks: one node got group rank 0 and prints the step lines, for both.
    leader = [rank for rank in (0, 1) if re.search(r"group_rank=0\b", logs[rank])]
    assert len(leader) == 1, logs
    text = logs[leader[0]]
    assert f"training ops-test-{leader[0]}: 2 rank(s)" in text  # pass-through flags reach the trainer
    assert [int(n) for n in re.findall(r"step\s+(\d+)/3 \| loss", text)] == [1, 2, 3]
    print(f"two-node cluster_train.sh run: {elapsed:.1f} s")
    assert not tagged_pids(env["OPEN_DILOCO_TEST_TAG"])
