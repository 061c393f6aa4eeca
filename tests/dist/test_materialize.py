"""The meta-device build under real torchrun (gloo, CPU): the same θ for every rank count and flag, local
weights read shard by shard, and no rank ever holding the whole model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from open_diloco.model import build_model
from tests.conftest import REPO, TINY_MODEL, TORCHRUN, trainer_env
from tests.dist.materialize_probe import tensor_hash

pytestmark = pytest.mark.dist

PROBE = Path(__file__).with_name("materialize_probe.py")
MODEL_100M = REPO / "configs" / "models" / "llama-100m-fresh"
MIB = 2**20


def probe(
    tmp_path: Path, nproc: int, path_model: Path, *, mode="meta", ac=False, hashes=True, seed=7
) -> dict:
    out = tmp_path / f"{mode}-{nproc}-{ac}-{path_model.name}.json"
    cmd = [
        *TORCHRUN,
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(PROBE),
        str(path_model),
        str(seed),
        mode,
        "ac" if ac else "no-ac",
        "hashes" if hashes else "no-hashes",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_same_theta_for_one_and_two_ranks_and_the_unsharded_build(tmp_path):
    one = probe(tmp_path, 1, TINY_MODEL)["hashes"]
    two = probe(tmp_path, 2, TINY_MODEL, ac=True)["hashes"]
    full = build_model(TINY_MODEL, seed=7)
    unsharded = {name: tensor_hash(param) for name, param in full.named_parameters()}
    unsharded.update({f"buffer:{name}": tensor_hash(buf) for name, buf in full.named_buffers()})
    unsharded["tied"] = False
    assert one == two == unsharded
    # another seed, another θ (the unsharded build draws as the ranks do, as just checked)
    assert tensor_hash(build_model(TINY_MODEL, seed=8).lm_head.weight) != one["lm_head.weight"]


def test_weights_are_read_shard_by_shard_and_tied_embeddings_stay_tied(tmp_path):
    config = json.loads((TINY_MODEL / "config.json").read_text())
    saved = tmp_path / "tied"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = build_model(saved, seed=3)
    for param in model.parameters():
        param.data.add_(0.5)  # not what a fresh init of any seed gives
    model.save_pretrained(saved, safe_serialization=True)
    expected = {name: tensor_hash(param) for name, param in model.named_parameters()}
    got = probe(tmp_path, 2, saved, seed=99)["hashes"]
    assert got["tied"] is True
    assert {name: got[name] for name in expected} == expected


def test_two_rank_meta_build_never_holds_the_whole_model(tmp_path):
    """100M config: a rank's host memory grows by at most its shard + the largest parameter + 64 MiB (the
    largest transient: ``to_empty`` allocates the root unit's shards, embedding and head, before FSDP2 moves
    them into its padded storage; measured 48-59 MiB above the shard), while the old build (the whole model
    on every rank) grows by at least the whole model."""
    meta = probe(tmp_path, 2, MODEL_100M, hashes=False)["memory"]
    full = probe(tmp_path, 2, MODEL_100M, mode="full", hashes=False)["memory"]
    for rank in meta:
        grown = rank["rss_peak"] - rank["rss_before"]
        bound = rank["shard_bytes"] + rank["largest_param_bytes"] + 64 * MIB
        assert grown <= bound, (grown / MIB, bound / MIB)
        assert grown < rank["full_bytes"] * 0.75, (grown / MIB, rank["full_bytes"] / MIB)
    for rank in full:
        assert rank["rss_peak"] - rank["rss_before"] >= rank["full_bytes"] * 0.9


def test_dry_run_reports_memory_and_seconds_and_exits(tmp_path):
    """``--dry-run`` on the 25M config, no data flags and a galaxy flag it ignores: one line for a person and
    one JSON line, exit 0, nothing written."""
    cmd = [
        TORCHRUN[0],
        str(REPO / "open_diloco" / "train_fsdp.py"),
        "--dry-run",
        "--path-model",
        str(REPO / "configs" / "models" / "llama-25m-fresh"),
        "--no-torch-compile",
        "--seq-length",
        "64",
        "--per-device-train-batch-size",
        "2",
        "--total-batch-size",
        "4",
        "--hv.galaxy-size",
        "2",
        "--metric-logger-type",
        "jsonl",
        "--metrics-path",
        str(tmp_path / "metrics.jsonl"),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=trainer_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-2].startswith("dry run: 1 rank(s) on cpu, 32-true, 26.2M params"), lines
    report = json.loads(lines[-1])["dry_run"]
    assert report["params"] == report["shard_params"] == 26_223_104
    assert 0 < report["host_peak_at_start_gib"] <= report["host_peak_gib"] < 4
    assert (
        report["device_peak_gib"] == 0 and 0 < report["first_step_seconds"] < report["seconds_to_first_step"]
    )
    assert 0 < report["loss"] < 20
    assert list(tmp_path.iterdir()) == []
