"""Checkpoint and resume under real torchrun: bit-exact resume after a kill, resharding, atomic saves,
refusal of bad checkpoints, and export to a transformers directory."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from open_diloco.checkpoint import read_metadata, resolve_resume
from open_diloco.config.run import CkptConfig
from open_diloco.errors import ConfigError
from open_diloco.model import load_model_config
from open_diloco.sample_log import read_sample_logs
from tests.conftest import (
    REPO,
    SHALLOW_MODEL,
    TORCHRUN,
    TRAIN_SCRIPT,
    kill_tree,
    read_metrics,
    trainer_env,
    with_overrides,
)

# one worker runs this module: its tests compare with one uninterrupted run (the module's `straight`)
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("dist_checkpoint")]

ARGS = [
    "--path-model",
    str(SHALLOW_MODEL),
    "--fake-data",
    "--no-torch-compile",
    "--seq-length",
    "64",
    "--lr",
    "1e-2",
    "--per-device-train-batch-size",
    "4",
    "--total-batch-size",
    "8",
    "--total-steps",
    "40",
    "--num-workers",
    "1",
    "--metric-logger-type",
    "jsonl",
]


def command(nproc: int, metrics: Path, *extra: str) -> list[str]:
    launcher = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [TORCHRUN[0]]
    flags = with_overrides([*ARGS, "--max-steps", "40"], extra)
    return [*launcher, str(TRAIN_SCRIPT), *flags, "--metrics-path", str(metrics)]


def run(nproc: int, metrics: Path, *extra: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        command(nproc, metrics, *extra),
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if expect_ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def start_and_kill_when(nproc: int, metrics: Path, ready, *extra: str, timeout: float = 240) -> None:
    """Start a cluster, SIGKILL its whole process group once ``ready()`` holds; assert it is gone."""
    proc = subprocess.Popen(
        command(nproc, metrics, *extra),
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the kill point"
    finally:
        kill_tree(proc.pid)  # asserts that torchrun and every worker are gone
        proc.wait(timeout=30)


def losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(metrics)}


def last_step(metrics: Path) -> int:
    return max(losses(metrics), default=0) if metrics.exists() else 0


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> tuple[dict[int, float], Path, dict[int, list[int]]]:
    """One uninterrupted 2-rank run of 40 steps, checkpointed every 20: its losses, the reference of every
    resume, its step-20 checkpoint, which tests resume from (into their own directories) or spoil copies
    of, and the samples the cluster trained each step (``--sample-log``)."""
    root = tmp_path_factory.mktemp("straight")
    samples = ["--sample-log", str(root / "samples")]
    run(2, root / "m.jsonl", "--ckpt.interval", "20", "--ckpt.path", str(root / "ckpt"), *samples)
    return losses(root / "m.jsonl"), root / "ckpt" / "step_00000020", trained_samples(root / "samples")


def trained_samples(directory: Path) -> dict[int, list[int]]:
    """The ids a cluster's ranks trained at each step (rank 0's, then rank 1's), from their sample logs; of a
    step trained twice (a resume replays the steps after its checkpoint), the last time."""
    last = {(line["step"], line["rank"]): line["sample_ids"] for line in read_sample_logs(directory)}
    steps: dict[int, list[int]] = {}
    for step, rank in sorted(last):
        steps.setdefault(step, []).extend(last[step, rank])
    return steps


@pytest.fixture(scope="module")
def straight(straight_run) -> dict[int, float]:
    return straight_run[0]


@pytest.fixture(scope="module")
def step_20(straight_run) -> Path:
    return straight_run[1]


@pytest.fixture(scope="module")
def straight_samples(straight_run) -> dict[int, list[int]]:
    return straight_run[2]


def test_kill_and_resume_is_bit_exact(tmp_path, straight, straight_samples):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    samples = ["--sample-log", str(tmp_path / "samples")]
    # saves are written in the background: kill once step 20's checkpoint is published and training went on
    published = lambda: last_step(first) >= 23 and (ckpt / "step_00000020").is_dir()  # noqa: E731
    start_and_kill_when(2, first, published, "--ckpt.interval", "20", "--ckpt.path", str(ckpt), *samples)
    assert [p.name for p in ckpt.iterdir()] == ["step_00000020"]
    proc = run(
        2, second, "--ckpt.interval", "20", "--ckpt.path", str(ckpt), "--ckpt.resume", "latest", *samples
    )
    assert "resumed from" in proc.stdout
    resumed = losses(second)
    assert sorted(resumed) == list(range(21, 41)), proc.stdout[-3000:]
    # bit-exact: fp32 on CPU, same reduction order, state restored exactly
    assert [resumed[s] for s in range(21, 41)] == [straight[s] for s in range(21, 41)]
    # and from what the loaders handed the models: the killed run and its resume trained, step by step, the
    # samples of the straight run (the steps after the checkpoint twice: once before the kill, once after)
    assert trained_samples(tmp_path / "samples") == straight_samples
    lines = read_sample_logs(tmp_path / "samples")
    assert len(lines) >= 2 * (40 + 3)  # steps 21..23 at least were trained before the kill too
    assert all(line["sample_ids"] == straight_samples[line["step"]][4 * line["rank"] :][:4] for line in lines)
    assert len({i for ids in straight_samples.values() for i in ids}) == 40 * 8


def test_resume_with_fewer_ranks_reshards(tmp_path, straight, step_20, straight_samples):
    second = tmp_path / "second.jsonl"
    run(
        1, second, "--ckpt.resume", str(step_20), "--sample-log", str(tmp_path / "samples")
    )  # saved by 2 ranks
    resumed = losses(second)
    assert sorted(resumed) == list(range(21, 41))
    # one rank takes each step what the two took together (accumulation 2), in the same order
    assert trained_samples(tmp_path / "samples") == {s: straight_samples[s] for s in range(21, 41)}
    # one rank sees the same global batches; only the reduction order differs
    for step in range(21, 41):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-3)


def test_kill_during_save_leaves_previous_checkpoint_usable(tmp_path):
    ckpt = tmp_path / "ckpt"
    for attempt in range(4):
        metrics = tmp_path / f"kill{attempt}.jsonl"
        shutil.rmtree(ckpt, ignore_errors=True)

        def saving(metrics: Path = metrics) -> bool:
            return last_step(metrics) >= 6 and any(p.name.endswith(".tmp") for p in ckpt.glob("*"))

        start_and_kill_when(
            2, metrics, saving, "--ckpt.interval", "1", "--ckpt.keep", "2", "--ckpt.path", str(ckpt)
        )
        if any(p.name.endswith(".tmp") for p in ckpt.iterdir()):
            break
    else:
        pytest.fail("never caught a save in flight")
    complete = sorted(p.name for p in ckpt.iterdir() if not p.name.endswith(".tmp"))
    assert complete, "the previous checkpoint must survive"
    resumed = tmp_path / "resumed.jsonl"
    saved_step = int(complete[-1][len("step_") :])
    run(2, resumed, "--ckpt.path", str(ckpt), "--ckpt.resume", "latest", "--max-steps", str(saved_step + 2))
    after_resume, before_kill = losses(resumed), losses(metrics)
    assert sorted(after_resume) == [saved_step + 1, saved_step + 2]
    # the killed run had already trained past the checkpoint: the resumed run retraces it exactly
    common = set(after_resume) & set(before_kill)
    assert common and all(after_resume[s] == before_kill[s] for s in common)


def test_a_stop_signal_during_a_background_save_leaves_only_complete_checkpoints(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    # no loader worker: a SIGTERMed worker can turn the rank's Stop into the DataLoader's RuntimeError (a
    # shutdown race of its own, not this test's subject)
    flags = ["--ckpt.interval", "1", "--ckpt.keep", "3", "--ckpt.path", str(ckpt), "--num-workers", "0"]
    proc = subprocess.Popen(
        command(2, metrics, *flags),
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (last_step(metrics) >= 6 and any(p.name.endswith(".tmp") for p in ckpt.glob("*"))):
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the run ended before a save was caught"
            )
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to both ranks
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode != 0 and "stopping: signal SIGTERM" in output, output[-3000:]
    complete = [p for p in ckpt.iterdir() if not p.name.endswith(".tmp")]
    assert complete, output[-3000:]
    for path in complete:  # published means whole: every one loads its metadata and resumes
        assert read_metadata(path)["step"] == int(path.name[len("step_") :])
    saved_step = max(read_metadata(path)["step"] for path in complete)
    resumed = tmp_path / "resumed.jsonl"
    run(2, resumed, "--ckpt.path", str(ckpt), "--ckpt.resume", "latest", "--max-steps", str(saved_step + 1))
    assert sorted(losses(resumed)) == [saved_step + 1]


def test_bad_checkpoints_are_refused_with_one_line(tmp_path, step_20):
    good = step_20

    def refused(path: Path, *extra: str, nproc: int = 2) -> str:
        started = time.monotonic()
        proc = run(nproc, tmp_path / "x.jsonl", "--ckpt.resume", str(path), *extra, expect_ok=False)
        assert proc.returncode != 0 and time.monotonic() - started < 60
        ours = [line for line in proc.stderr.splitlines() if line.startswith("open-diloco: error:")]
        assert ours, proc.stderr[-2000:]
        return ours[0]

    def vetted(path: Path, config_json: Path = SHALLOW_MODEL / "config.json") -> str:
        """What the trainer's check before any rank talks says, in this process: the refusals that need no
        shard read are checked here, the one-line exit they take through the trainer twice below."""
        with pytest.raises(ConfigError) as refusal:
            resolve_resume(CkptConfig(resume=str(path)), load_model_config(config_json.parent).to_dict())
        return str(refusal.value)

    # another model, through the trainer (one process): its one line and exit
    other_model = tmp_path / "other-model"
    other_model.mkdir()
    (other_model / "config.json").write_text(
        (SHALLOW_MODEL / "config.json").read_text().replace('"hidden_size": 128', '"hidden_size": 64')
    )
    assert "made for another model (hidden_size 128 vs 64, head_dim 32 vs 16)" in refused(
        good, "--path-model", str(other_model), nproc=1
    )
    # another head size: the same hidden size, other attention shapes
    (other_model / "config.json").write_text(
        (SHALLOW_MODEL / "config.json")
        .read_text()
        .replace('"hidden_size": 128', '"hidden_size": 128, "head_dim": 16')
    )
    assert "made for another model (head_dim 32 vs 16)" in vetted(good, other_model / "config.json")
    # partial: no metadata
    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / "metadata.json").unlink()
    assert "is incomplete" in vetted(partial)
    assert "does not exist" in vetted(tmp_path / "nowhere")
    # corrupt shard file, detected at load time on every rank (through the trainer, two ranks)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    shard = next(corrupt.glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    assert "could not be loaded" in refused(corrupt)


def test_export_round_trip(tmp_path, step_20):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM

    source = step_20  # two ranks' shards, 20 steps trained
    out = tmp_path / "exported"
    proc = subprocess.run(
        [str(Path(TORCHRUN[0]).parent / "open-diloco"), "export", str(source), str(out)],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()

    # reference: the trained weights read by DCP's own converter, into a fresh model
    dcp_to_torch_save(source, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(SHALLOW_MODEL)).eval()
    reference.load_state_dict(full)
    tokens = torch.randint(
        0, reference.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(SHALLOW_MODEL)).eval()
    with torch.no_grad():
        assert not torch.allclose(fresh(tokens).logits, reference(tokens).logits)
