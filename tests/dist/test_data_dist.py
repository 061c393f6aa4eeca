"""Real data under real torchrun (2 ranks, gloo): disjoint ranks and clusters, repeatable runs, exact resume,
loss falls on real text, and a bad input stops every rank with the same one-line error."""

from __future__ import annotations

import json
import subprocess
import time
from itertools import islice
from pathlib import Path

import pytest

from open_diloco.config import Config
from open_diloco.data import build_train_loader, plan_data
from tests.data_corpus import TINY_MODEL, TORCHRUN, TRAIN_SCRIPT, offline_env, text_dir

pytestmark = pytest.mark.dist

PROBE = Path(__file__).with_name("data_probe.py")
GALAXY, BATCHES, SEED = 2, 6, 11


def _torchrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(command, capture_output=True, text=True, env=offline_env(), timeout=timeout)


def _probe(corpus: Path, cache: Path, out: Path) -> list[dict]:
    out.mkdir()
    done = _torchrun(str(PROBE), str(corpus), str(cache), str(out), str(SEED), str(GALAXY), str(BATCHES))
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_and_clusters_disjoint_runs_repeat_and_resume(tmp_path: Path) -> None:
    corpus = text_dir(tmp_path, 40)
    first = _probe(corpus, tmp_path / "cache1", tmp_path / "run1")
    # Both ranks packed into the same fresh cache at once: one packed, the other waited; nothing left behind.
    assert [p.suffix for p in (tmp_path / "cache1").iterdir()] == [""]

    seen: list[int] = []
    for cluster in map(str, range(GALAXY)):
        ranks = [first[r][cluster]["ids"] for r in range(2)]
        seen += [i for batches in ranks for batch in batches for i in batch]
        for r in range(2):
            assert first[r][cluster]["resumed_ids"] == ranks[r][BATCHES // 2 :]
        # The cluster's two ranks see, block by block, what one process with accumulation sees.
        config = Config(
            dataset_path=str(corpus),
            data_cache_dir=tmp_path / "cache1",
            seq_length=64,
            seed=SEED,
            per_device_train_batch_size=4,
            total_batch_size=4,
        )
        plan = plan_data(config, 2048, world_size=1, galaxy_rank=int(cluster), galaxy_size=GALAXY)
        single = build_train_loader(plan, per_device_batch=4, rank=0, world_size=1, num_workers=0)
        for step, batch in enumerate(islice(iter(single), BATCHES)):
            assert batch["sample_id"].tolist() == ranks[0][step] + ranks[1][step]
    assert len(seen) == len(set(seen)) == GALAXY * 2 * BATCHES * 2  # every rank of every cluster: disjoint

    again = _probe(corpus, tmp_path / "cache2", tmp_path / "run2")  # packed again from scratch, same seed
    assert again == first


def test_training_on_real_text_loss_falls_and_val_loss_is_logged(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    done = _torchrun(
        str(TRAIN_SCRIPT),
        "--path-model",
        str(TINY_MODEL),
        "--no-torch-compile",
        "--dataset-path",
        str(text_dir(tmp_path, 40)),
        "--data-cache-dir",
        str(tmp_path / "cache"),
        "--seq-length",
        "128",
        "--per-device-train-batch-size",
        "4",
        "--total-batch-size",
        "8",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "2",
        "--max-steps",
        "12",
        "--eval-interval",
        "6",
        "--eval-samples",
        "16",
        "--num-workers",
        "1",
        "--metric-logger-type",
        "jsonl",
        "--metrics-path",
        str(metrics),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0] - 2.0, losses
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert [step for step, _ in val] == [6, 12] and val[1][1] < val[0][1], val
    assert "| val " in done.stdout


def test_bad_data_stops_every_rank_with_the_same_line(tmp_path: Path) -> None:
    # The field is missing only in a later record: found while packing by one rank, re-raised by the other.
    data = tmp_path / "late.jsonl"
    data.write_text(json.dumps({"text": "fine " * 50}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    started = time.monotonic()
    done = _torchrun(
        str(TRAIN_SCRIPT),
        "--path-model",
        str(TINY_MODEL),
        "--no-torch-compile",
        "--dataset-path",
        str(data),
        "--data-cache-dir",
        str(tmp_path / "cache"),
        "--seq-length",
        "16",
        timeout=90,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("open-diloco: error:")]
    assert done.returncode != 0 and time.monotonic() - started < 60
    assert len(errors) == 2 and errors[0] == errors[1] and "a record has no text field 'text'" in errors[0], (
        done.stderr
    )
