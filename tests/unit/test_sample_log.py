"""``--sample-log``: what a rank's model took from its loader, per inner step, as the loader read it."""

from __future__ import annotations

from pathlib import Path

from open_diloco.config import Config
from open_diloco.data import build_train_loader, plan_data
from open_diloco.sample_log import NullSampleLog, open_sample_log, read_sample_logs


def test_each_step_logs_the_ids_its_batches_carried_and_a_reposition_continues_from_there(tmp_path: Path):
    config = Config(fake_data=True, seq_length=16, per_device_train_batch_size=2, total_batch_size=8, seed=3)
    plan = plan_data(config, 256, world_size=2, galaxy_rank=1, galaxy_size=2)
    loader = build_train_loader(plan, per_device_batch=2, rank=1, world_size=2, num_workers=0)
    log = open_sample_log(tmp_path / "samples", "run", galaxy_rank=1, rank=1)
    watched = log.watch(loader)
    taken = []
    batches = iter(watched)
    for step in (1, 2):  # two micro-batches a step: accumulation 2 on 2 ranks of batch 2
        taken.append([i for _ in range(2) for i in next(batches)["sample_id"].tolist()])
        log.record(step, step)
    watched.sampler.next_block = 1  # the trainer repositions the loader (a take, a hold): step 2 again
    batches = iter(watched)
    taken.append([i for _ in range(2) for i in next(batches)["sample_id"].tolist()])
    log.record(2, 1)
    log.close()

    lines = read_sample_logs(tmp_path / "samples")
    assert [line["sample_ids"] for line in lines] == taken == [[2, 3, 6, 7], [10, 11, 14, 15], [6, 7, 10, 11]]
    assert [(line["step"], line["inner_steps"]) for line in lines] == [(1, 1), (2, 2), (2, 1)]
    assert all(line["galaxy_rank"] == 1 and line["rank"] == 1 for line in lines)
    assert [path.name for path in (tmp_path / "samples").iterdir()] == ["run.rank1.jsonl"]


def test_off_the_loader_is_untouched_and_nothing_is_written(tmp_path: Path):
    log = open_sample_log(None, "run", galaxy_rank=0, rank=0)
    loader = object()
    assert isinstance(log, NullSampleLog) and log.watch(loader) is loader
    log.record(1, 1)
    log.close()
    assert not any(tmp_path.iterdir())
