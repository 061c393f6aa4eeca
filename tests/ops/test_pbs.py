"""scripts/pbs/cluster.pbs without PBS: a stand-in pbsdsh runs each node's command here, and a stand-in
cluster_train.sh (through OPEN_DILOCO_ROOT) records what every node was asked to do."""

from __future__ import annotations

import json
import os
import subprocess

from tests.conftest import REPO

FAKE_PBSDSH = """#!/usr/bin/env bash
# pbsdsh -n SLOT -- bash -c CMD: run CMD here, with as little environment as the real one passes.
[[ "$1" == -n && "$3" == -- ]] || exit 9
echo "$2" >> "$(dirname "$0")/slots"
shift 3
exec env -i HOME="$HOME" "$@"
"""
FAKE_CLUSTER_TRAIN = """#!/usr/bin/env bash
python3 - "$@" <<'PY'
import json, os, sys
keep = ("BACKEND", "NPROC_PER_NODE", "RDZV_ID", "VENV")
env = {k: os.environ[k] for k in keep if k in os.environ}
record = {"args": sys.argv[1:], "cwd": os.getcwd(), "env": env}
with open(os.path.join("RECORD_DIR", f"node{sys.argv[3]}.json"), "w") as out:
    json.dump(record, out)
PY
"""


def test_pbs_script_starts_one_cluster_train_per_node(tmp_path):
    bin_dir, fake_root = tmp_path / "bin", tmp_path / "root"
    (fake_root / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    recorder = FAKE_CLUSTER_TRAIN.replace("RECORD_DIR", str(tmp_path))
    for path, text in ((bin_dir / "pbsdsh", FAKE_PBSDSH), (fake_root / "scripts/cluster_train.sh", recorder)):
        path.write_text(text)
        path.chmod(0o755)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("gpu-a\ngpu-a\ngpu-b\ngpu-b\n")  # two MPI slots on each of two hosts
    workdir = tmp_path / "work dir"  # a space, to prove the quoting
    workdir.mkdir()
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "PBS_JOBID": "4321.pbs-server",
        "PBS_NODEFILE": str(nodefile),
        "PBS_O_WORKDIR": str(workdir),
        "OPEN_DILOCO_ROOT": str(fake_root),
        "CONFIG": "configs/my run.toml",
        "TRAINER_ARGS": "--hv.galaxy-size 2 --hv.world-rank 1",
        "BACKEND": "gloo",
        "VENV": "/opt/venv",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/pbs/cluster.pbs")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 node(s) gpu-a gpu-b, master gpu-a:24321" in proc.stdout
    assert sorted((bin_dir / "slots").read_text().split()) == ["0", "2"]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"node{rank}.json").read_text())
        assert record["args"] == [
            "configs/my run.toml",
            "2",
            str(rank),
            "gpu-a",
            "24321",
            "--hv.galaxy-size",
            "2",
            "--hv.world-rank",
            "1",
        ]
        assert record["cwd"] == str(workdir)
        assert record["env"] == {"BACKEND": "gloo", "RDZV_ID": "4321.pbs-server", "VENV": "/opt/venv"}
