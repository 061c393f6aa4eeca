"""cluster_train.sh stops before torchrun when a preflight check fails: one FAIL line with the fix, a
non-zero exit within seconds, the failure in the node's log, torchrun never started, nothing left running."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.ops.launch import SCRIPT, kill_tagged, launcher_env, write_config

PEER_ID = "QmXc1oLBNYWfMVjXbqVaAkGLhZ5vmjzxTqqgYkomR4HTfo"


def launch(tmp_path, *args: str, timeout: float = 60, **env_extra: str):
    env, torchrun_marker = launcher_env(tmp_path, **env_extra)
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
    finally:
        left = kill_tagged(env["OPEN_DILOCO_TEST_TAG"])
    assert not left, f"processes left behind: {left}"
    return proc, time.monotonic() - started, torchrun_marker


def assert_stopped_before_torchrun(tmp_path, proc, elapsed, torchrun_marker, failed_check: str, message: str):
    fails = [line for line in proc.stdout.splitlines() if line.startswith("preflight: FAIL")]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(fails) == 1 and fails[0].startswith(f"preflight: FAIL {failed_check}"), proc.stdout
    assert message in fails[0] and "; fix: " in fails[0], fails[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not torchrun_marker.exists(), "torchrun was started"
    log = next(
        (tmp_path / "logs" / "distributed_training").glob("cluster_train_latest_node*.log")
    ).read_text()
    assert fails[0] in log and "torchrun not started" in log
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_bad_config_stops_before_torchrun(tmp_path):
    config = (
        write_config(tmp_path / "bad.toml")
        .read_text()
        .replace("total_batch_size = 8", "total_batch_size = 6")
    )
    (tmp_path / "bad.toml").write_text(config)
    proc, elapsed, marker = launch(tmp_path, "bad.toml")
    assert_stopped_before_torchrun(
        tmp_path,
        proc,
        elapsed,
        marker,
        "config",
        "--total-batch-size 6 is not a multiple of --per-device-train-batch-size 4",
    )


def test_bad_config_through_venv_activation(tmp_path):
    # Same failure, with the environment found through VENV alone (no venv on PATH).
    if not Path(sys.prefix, "bin", "activate").is_file():
        pytest.skip("tests do not run inside a virtualenv")
    write_config(tmp_path / "bad.toml", "lr = -1.0\n")
    proc, elapsed, marker = launch(tmp_path, "bad.toml", VENV=sys.prefix, PATH="/usr/bin:/bin")
    assert Path(sys.prefix, "bin", "python3").as_posix() in proc.stdout
    assert_stopped_before_torchrun(
        tmp_path, proc, elapsed, marker, "config", "--lr: Input should be greater than 0"
    )


def test_unreachable_master_stops_node_1(tmp_path):
    write_config(tmp_path / "ok.toml")
    proc, elapsed, marker = launch(
        tmp_path, "ok.toml", "2", "1", "127.0.0.1", str(free_port()), MASTER_WAIT="2"
    )
    assert_stopped_before_torchrun(
        tmp_path, proc, elapsed, marker, "master", "cannot reach the master at 127.0.0.1:"
    )


@pytest.mark.parametrize("where", ["flag", "config"])
def test_unreachable_dht_peer_stops_the_launch(tmp_path, where):
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{PEER_ID}"
    if where == "config":
        write_config(tmp_path / "ok.toml", f'[hv]\ninitial_peers = ["{maddr}"]\n')
        args = ["ok.toml", "--hv.world-rank", "0"]
    else:
        write_config(tmp_path / "ok.toml")
        args = ["ok.toml", "--hv.galaxy-size", "2", "--hv.world-rank", "1", "--hv.initial-peers", maddr]
    proc, elapsed, marker = launch(tmp_path, *args)
    assert_stopped_before_torchrun(tmp_path, proc, elapsed, marker, "dht-peers", "DHT peer 127.0.0.1:")


def test_usage_errors_and_help(tmp_path):
    proc = subprocess.run(
        [str(SCRIPT), "cfg.toml", "two"], cwd=tmp_path, capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 2 and "NUM_NODES must be a positive integer" in proc.stderr
    proc = subprocess.run(
        [str(SCRIPT), "cfg.toml", "2", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 2 and "NODE_RANK must be in 0..1" in proc.stderr
    proc = subprocess.run([str(SCRIPT), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0
    for word in ("NPROC_PER_NODE", "BACKEND", "LOG_LEVEL", "CONDA_ENV", "VENV", "--hv.world-rank", "latest"):
        assert word in proc.stdout
    assert not (tmp_path / "logs").exists()
