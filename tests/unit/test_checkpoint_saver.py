"""Background checkpoint saves, in one process (a one-rank gloo group): the copy is taken before training
changes the weights, publishing is atomic and pruned, an abandoned save is never taken for a checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from open_diloco import checkpoint
from open_diloco.config import CkptConfig, HvConfig
from open_diloco.model import build_model
from open_diloco.optim import build_inner_optimizer
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.testing import InProcessGalaxy
from open_diloco.parallelize import parallelize
from tests.conftest import TINY_MODEL


@pytest.fixture(scope="module")
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def trained(seed: int = 0):
    """Model, optimizer and outer loop (with outer momentum) after one inner and one outer step."""
    model = parallelize(build_model(TINY_MODEL, seed=seed), torch.device("cpu"), "32-true", False, False)
    optimizer = build_inner_optimizer(model, 1e-2, 0.1, (0.9, 0.95))
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    numel = sum(p.numel() for p in model.parameters())
    hv = HvConfig(local_steps=1, outer_lr=0.7, outer_momentum=0.9)
    outer = DiLoCo(model, InProcessGalaxy(1).averager(0, numel), hv, warn=lambda *_: None)
    outer.step()
    return model, optimizer, outer


class SlowWrites:
    """Holds every DCP write until released, so a test can act while a save is in flight."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        real_save = checkpoint.dcp.save

        def held_save(*args, **kwargs):
            assert self.release.wait(30)
            return real_save(*args, **kwargs)

        monkeypatch.setattr(checkpoint.dcp, "save", held_save)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


def test_the_copy_is_taken_before_training_changes_the_weights(process_group, tmp_path, monkeypatch):
    model, optimizer, outer = trained()
    saver = checkpoint.CheckpointSaver(tmp_path, keep=3, config={}, model_config=model.config.to_dict())
    before = weights(model)
    slow = SlowWrites(monkeypatch)
    saver.start(1, model=model, optimizer=optimizer, outer=outer)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next inner step, while the save is being written
    assert checkpoint.list_checkpoints(tmp_path) == []  # not published before it is written
    slow.release.set()
    saved = saver.wait()
    assert saved == checkpoint.step_dir(tmp_path, 1) and checkpoint.list_checkpoints(tmp_path) == [saved]

    fresh_model, fresh_optimizer, fresh_outer = trained(seed=1)
    step = checkpoint.load(
        saved,
        checkpoint.read_metadata(saved),
        model=fresh_model,
        optimizer=fresh_optimizer,
        outer=fresh_outer,
    )
    assert step == 1
    loaded = weights(fresh_model)
    assert all(torch.equal(loaded[name], before[name]) for name in before)
    assert torch.equal(fresh_outer.state.momentum_buffer, outer.state.momentum_buffer)
    saver.close(timeout=1)


def test_saves_are_published_one_at_a_time_and_pruned(process_group, tmp_path, caplog):
    model, optimizer, outer = trained()
    saver = checkpoint.CheckpointSaver(
        tmp_path, keep=2, config={"lr": 1}, model_config=model.config.to_dict()
    )
    for step in (1, 2, 3):
        saver.start(step, model=model, optimizer=optimizer, outer=outer)  # each waits for the one before
    saver.wait()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert not list(tmp_path.glob("*.tmp"))
    assert checkpoint.read_metadata(tmp_path / "step_00000003")["config"] == {"lr": 1}
    saver.close(timeout=1)


def test_a_save_abandoned_at_a_stop_is_never_taken_for_a_checkpoint(
    process_group, tmp_path, monkeypatch, caplog
):
    model, optimizer, outer = trained()
    saver = checkpoint.CheckpointSaver(tmp_path, keep=3, config={}, model_config=model.config.to_dict())
    saver.start(1, model=model, optimizer=optimizer, outer=outer)
    saver.wait()
    slow = SlowWrites(monkeypatch)
    saver.start(2, model=model, optimizer=optimizer, outer=outer)
    saver.close(timeout=0.2)  # the stop's bounded wait runs out
    assert "abandoned checkpoint step_00000002" in caplog.text
    slow.release.set()  # the write may even finish afterwards: it must still not be published
    saver._writer.shutdown(wait=True)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert not (Path(tmp_path) / "step_00000002").exists()
    assert (
        checkpoint.resolve_resume(CkptConfig(path=tmp_path, resume="latest"), model.config.to_dict())[0].name
        == "step_00000001"
    )
