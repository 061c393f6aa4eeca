"""Run under torchrun by tests/dist/test_data_dist.py: build this rank's train loader exactly as the trainer
does (plan_data + build_train_loader, background worker) for every cluster of a galaxy, and dump the sample
ids and a hash of the tokens of each batch, plus the batches a loader restored from a mid-way state_dict
yields."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from open_diloco.config import Config
from open_diloco.data import build_train_loader, plan_data
from open_diloco.world import describe_world

PER_DEVICE, SEQ_LENGTH, MODEL_VOCAB = 2, 64, 2048


def probe(dataset_path: str, cache_dir: str, seed: int, galaxy_size: int, batches: int) -> dict[str, dict]:
    world = describe_world("cpu", "gloo")
    config = Config(
        dataset_path=dataset_path,
        data_cache_dir=Path(cache_dir),
        seq_length=SEQ_LENGTH,
        seed=seed,
        per_device_train_batch_size=PER_DEVICE,
        total_batch_size=PER_DEVICE * world.world_size,
    )
    result: dict[str, dict] = {}
    for galaxy_rank in range(galaxy_size):
        plan = plan_data(config, MODEL_VOCAB, world.world_size, galaxy_rank, galaxy_size)
        args = dict(per_device_batch=PER_DEVICE, rank=world.rank, world_size=world.world_size, num_workers=1)
        loader = build_train_loader(plan, **args)
        stream = iter(loader)
        ids, hashes, state = [], [], None
        for index in range(batches):
            if index == batches // 2:
                state = loader.state_dict()
            batch = next(stream)
            ids.append(batch["sample_id"].tolist())
            hashes.append(hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest())
        restored = build_train_loader(plan, **args)
        restored.load_state_dict(state)
        resumed = iter(restored)
        restored_ids = [next(resumed)["sample_id"].tolist() for _ in range(batches - batches // 2)]
        result[str(galaxy_rank)] = {"ids": ids, "hashes": hashes, "resumed_ids": restored_ids}
    return result


if __name__ == "__main__":
    dataset_path, cache_dir, out_dir, seed, galaxy_size, batches = sys.argv[1:7]
    rank = describe_world("cpu", "gloo").rank
    result = probe(dataset_path, cache_dir, int(seed), int(galaxy_size), int(batches))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
