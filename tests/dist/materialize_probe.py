"""Run under torchrun by tests/dist/test_materialize.py: build the sharded model the way the trainer does
(``meta``: build on meta, shard, materialise) or the way it did before (``full``: the whole model on every
rank, then shard), and write rank 0's JSON: each parameter's hash (of its gathered full tensor, when asked)
and every rank's host memory (RSS before the build, peak after) next to its shard's size."""

from __future__ import annotations

import hashlib
import json
import resource
import sys
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from open_diloco.config import Config
from open_diloco.materialize import canonical_name
from open_diloco.model import build_model
from open_diloco.outer.state import local_shards
from open_diloco.parallelize import parallelize
from open_diloco.trainer import build_sharded_model
from open_diloco.world import describe_world, join_process_group, leave_process_group


def tensor_hash(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's fp32 bytes (its full value for a DTensor)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return hashlib.sha256(full.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()[:16]


def main(path_model: str, seed: int, mode: str, checkpointing: bool, with_hashes: bool, out: str) -> None:
    world = describe_world("cpu", "gloo")
    join_process_group(world, 120.0)
    config = Config(
        fake_data=True,
        path_model=Path(path_model),
        seed=seed,
        activation_checkpointing=checkpointing,
        torch_compile=False,
    )
    rss_before = psutil.Process().memory_info().rss
    if mode == "meta":
        model = build_sharded_model(config, world, "32-true")
    else:
        model = parallelize(
            build_model(config.path_model, seed), world.device, "32-true", checkpointing, False
        )
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    memory = {
        "rss_before": rss_before,
        "rss_peak": rss_peak,
        "shard_bytes": 4 * sum(shard.numel() for shard in local_shards(model)),
        "largest_param_bytes": 4 * max(param.numel() for param in model.parameters()),
        "full_bytes": 4 * sum(param.numel() for param in model.parameters()),
    }
    hashes = {}
    if with_hashes:
        hashes = {canonical_name(name): tensor_hash(param) for name, param in model.named_parameters()}
        hashes.update({f"buffer:{name}": tensor_hash(buf) for name, buf in model.named_buffers()})
        hashes["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    memories = [None] * world.world_size
    dist.all_gather_object(memories, memory)
    if world.rank == 0:
        Path(out).write_text(json.dumps({"hashes": hashes, "memory": memories}))
    leave_process_group(synchronize=True)


if __name__ == "__main__":
    path, seed, mode, checkpointing, with_hashes, out = sys.argv[1:]
    main(path, int(seed), mode, checkpointing == "ac", with_hashes == "hashes", out)
