"""wandb as its users expect of a multi-run job: one run per cluster named after its galaxy rank, the clusters
of a galaxy in one group (the run id), and a cluster resumed from a checkpoint continuing its own run.
Offline: no network, no account (WANDB_MODE=offline, the runs written under tmp_path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from open_diloco.config import CkptConfig, Config, HvConfig
from open_diloco.metrics import WANDB_RUN_FILE, build_metrics

wandb = pytest.importorskip("wandb")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    wandb.teardown()  # ends wandb's service process: nothing outlives the test


def cluster(rank: int, ckpt: Path) -> Config:
    hv = HvConfig(run_id="galaxy-a", galaxy_size=2, world_rank=rank, local_steps=10)
    return Config(fake_data=True, metric_logger_type="wandb", hv=hv, ckpt=CkptConfig(path=ckpt, interval=10))


def started(config: Config, resumed_from: Path | None = None):
    metrics = build_metrics(config, True, "cluster-with-a-time", resumed_from)
    metrics.log({"step": 10, "loss": 2.5, "param_hash": "ab12"})
    metrics.close()
    return metrics.run


def test_clusters_of_a_galaxy_are_runs_of_one_group_named_after_their_rank(offline):
    first, second = started(cluster(0, offline / "ckpt0")), started(cluster(1, offline / "ckpt1"))
    assert (first.group, first.name) == ("galaxy-a", "cluster0")
    assert (second.group, second.name) == ("galaxy-a", "cluster1")
    assert first.id != second.id
    named = started(cluster(1, offline / "ckpt1").model_copy(update={"run_name": "eu-west"}))
    assert (named.group, named.name) == ("galaxy-a", "eu-west")


def test_a_resumed_cluster_continues_its_own_run(offline):
    ckpt = offline / "ckpt"
    first = started(cluster(1, ckpt))
    kept = json.loads((ckpt / WANDB_RUN_FILE).read_text())  # beside the checkpoints
    assert kept == {"run_id": first.id}
    resumed = started(cluster(1, ckpt), resumed_from=ckpt / "step_00000010")
    assert (resumed.id, resumed.group, resumed.name) == (first.id, "galaxy-a", "cluster1")
    # what wandb wrote: offline-run-<time>-<id>[-<n>], one directory per run started
    written = [path.name for path in (offline / "wandb").glob("offline-run-*")]
    assert len(written) == 2 and all(f"-{first.id}" in name for name in written), written
    fresh = started(cluster(1, ckpt))  # the same --ckpt.path without --ckpt.resume: a new run
    assert fresh.id != first.id and json.loads((ckpt / WANDB_RUN_FILE).read_text()) == {"run_id": fresh.id}


def test_a_checkpoint_without_a_kept_id_starts_a_new_run(offline):
    (offline / "old").mkdir()
    (offline / "old" / WANDB_RUN_FILE).write_text("not json")
    run = started(cluster(0, offline / "ckpt"), resumed_from=offline / "old" / "step_00000010")
    assert run.id and run.name == "cluster0"


def test_records_after_the_galaxys_clock_went_back_are_kept(offline):
    # a cluster that held apart goes back to the galaxy's clock (outer/catching_up.py): its steps repeat, and
    # wandb drops every record at a step it has passed, so they go on at wandb's next steps
    metrics = build_metrics(cluster(0, offline / "ckpt"), True, "cluster0", None)
    sent = []
    log = metrics.run.log
    metrics.run.log = lambda data, step=None: sent.append((step, dict(data))) or log(data, step=step)
    for step in (99, 100, 100, 96, 97, 97, 98):
        metrics.log({"step": step, "loss": float(step)})
    metrics.close()
    # two records at one step stay one row (two syncs ending at one step), before and after the shift
    assert [step for step, _ in sent] == [99, 100, 100, 101, 102, 102, 103]
    assert [data.get("galaxy_step") for _, data in sent] == [None, None, None, 96, 97, 97, 98]
    assert [data["loss"] for _, data in sent] == [99.0, 100.0, 100.0, 96.0, 97.0, 97.0, 98.0]
