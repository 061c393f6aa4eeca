"""The SLURM launchers under a real Slurm: slurmctld and two slurmd "nodes" on this host, configured in a
temp dir (Debian's slurm-wlm; skipped where its binaries are absent, or when not root, which slurmd needs)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from open_diloco.config import Config, HvConfig
from open_diloco.preflight import check_dht_peers
from tests.conftest import REPO, free_port
from tests.ops.launch import kill_tagged, launcher_env, tagged_pids, write_config

pytestmark = pytest.mark.slow
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
# What the job scripts ask of a GPU cluster, scaled down to this host.
SMALL = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]


def slurm_conf(d: Path) -> str:
    """slurm.conf of two one-CPU nodes on this host; their state, spool, logs and PID files go under ``d``."""
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 RealMemory=1000"
        for name in ("n1", "n2")
    )
    return f"""ClusterName=opstest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
MpiDefault=none
ReturnToService=2
{nodes}
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm(tmp_path_factory):
    """A running two-node Slurm cluster; yields the environment its clients need. Ends every daemon by PID."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"no Slurm here ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool/n1", "spool/n2", "log"):
        (d / sub).mkdir(parents=True)
    subprocess.run(["mungekey", "-c", "-f", "-k", str(d / "munge.key")], check=True, capture_output=True)
    (d / "munge.key").chmod(0o600)
    (d / "slurm.conf").write_text(slurm_conf(d))
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    conf = ["-f", str(d / "slurm.conf")]
    pid_files = [d / "munged.pid", d / "slurmctld.pid", d / "slurmd.n1.pid", d / "slurmd.n2.pid"]
    try:
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={d}/munge.sock",
                f"--key-file={d}/munge.key",
                f"--pid-file={d}/munged.pid",
                f"--log-file={d}/log/munged.log",
                f"--seed-file={d}/munge.seed",
            ],
            check=True,
            env=env,
        )
        subprocess.run(["slurmctld", *conf], check=True, env=env)
        for name in ("n1", "n2"):
            subprocess.run(["slurmd", *conf, "-N", name], check=True, env=env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True
            ).stdout
            if states.split() == ["idle", "idle"]:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"Slurm did not come up: {states!r}; see {d}/log")
        yield env
    finally:
        pids = [int(f.read_text()) for f in reversed(pid_files) if f.exists()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 15)
        deadline = time.monotonic() + 20
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "Slurm daemons left running"


def test_cluster_sbatch_trains_one_cluster_over_two_slurm_nodes(slurm, tmp_path):
    config = write_config(tmp_path / "cluster.toml")
    env, torchrun_marker = launcher_env(
        tmp_path, OPEN_DILOCO_ROOT=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    env["SLURM_CONF"] = slurm["SLURM_CONF"]
    try:
        proc = subprocess.run(
            [
                "sbatch",
                "--wait",
                *SMALL,
                "--output",
                str(tmp_path / "job.out"),
                str(REPO / "scripts/slurm/cluster.sbatch"),
                str(config),
                "--run-name",
                "slurm-test",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        left = kill_tagged(env["OPEN_DILOCO_TEST_TAG"])
    job_out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 0, proc.stderr + job_out[-4000:]
    assert not left, f"processes left behind: {left}"
    assert re.search(r"2 node\(s\) n\[1-2\], master 127\.0\.0\.1:", job_out)
    logs = [
        (tmp_path / "logs/distributed_training" / f"cluster_train_latest_node{rank}.log").read_text()
        for rank in (0, 1)
    ]
    assert all("torchrun exited with status 0" in log for log in logs)
    assert [int(n) for n in re.findall(r"step\s+(\d+)/3 \| loss", "".join(logs))] == [1, 2, 3]
    assert "training slurm-test: 2 rank(s)" in "".join(logs) and torchrun_marker.exists()


def test_dht_sbatch_publishes_a_reachable_multiaddr(slurm, tmp_path):
    maddr_file = tmp_path / "peers.txt"
    env, _ = launcher_env(
        tmp_path,
        DHT_MADDR_FILE=str(maddr_file),
        DHT_IDENTITY=str(tmp_path / "id.pem"),
        DHT_ANNOUNCE_HOST="127.0.0.1",
    )
    env["SLURM_CONF"] = slurm["SLURM_CONF"]
    port = free_port()
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            *SMALL,
            "--output",
            str(tmp_path / "dht.out"),
            str(REPO / "scripts/slurm/dht.sbatch"),
            str(port),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 90
        while not maddr_file.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        maddr = maddr_file.read_text().strip()
        assert re.fullmatch(rf"/ip4/127\.0\.0\.1/tcp/{port}/p2p/Qm\w+", maddr), maddr
        hv = HvConfig(initial_peers=[maddr])
        assert "accept connections" in check_dht_peers(Config(fake_data=True, hv=hv), 5)
    finally:
        subprocess.run(["scancel", job_id], env=env, check=True)
        deadline = time.monotonic() + 30
        while tagged_pids(env["OPEN_DILOCO_TEST_TAG"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = kill_tagged(env["OPEN_DILOCO_TEST_TAG"])
    assert not left, f"hivemind-dht left behind after scancel: {left}"
