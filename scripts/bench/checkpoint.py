"""Checkpoint cost: save time, load time and size of an open_diloco checkpoint (DCP, sharded, atomic, with the
outer momentum) vs a plain `torch.save` of the same model + optimizer state, measured in the same run.

    python scripts/bench/checkpoint.py                       # 2M and ~100M models, one process on CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from open_diloco import checkpoint
from open_diloco.config import HvConfig
from open_diloco.model import build_model
from open_diloco.optim import build_inner_optimizer
from open_diloco.outer.diloco import DiLoCo
from open_diloco.parallelize import parallelize

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests/support is shared
from tests.support.inprocess_galaxy import InProcessGalaxy  # noqa: E402


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def bench(path_model: str, workdir: Path) -> None:
    model = parallelize(build_model(Path(path_model), seed=0), torch.device("cpu"), "32-true", False, False)
    optimizer = build_inner_optimizer(model, 1e-3, 0.1, (0.9, 0.95))
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    numel = sum(p.numel() for p in model.parameters())
    outer = DiLoCo(model, InProcessGalaxy(1).averager(0, numel), HvConfig(local_steps=1, outer_momentum=0.9), warn=lambda *_: None)
    outer.step()  # creates the momentum buffer
    n_params = sum(p.numel() for p in model.parameters())
    model_config = model.config.to_dict()

    started = time.perf_counter()
    saved = checkpoint.save(workdir / "ckpt", 1, model=model, optimizer=optimizer, outer=outer, config={},
                            model_config=model_config, keep=1)
    save_s = time.perf_counter() - started
    started = time.perf_counter()
    checkpoint.load(saved, checkpoint.read_metadata(saved), model=model, optimizer=optimizer, outer=outer)
    load_s = time.perf_counter() - started

    started = time.perf_counter()
    plain = workdir / "plain.pt"
    torch.save({"model": {k: v.full_tensor() for k, v in model.state_dict().items()},
                "optim": optimizer.state_dict()}, plain)
    plain_s = time.perf_counter() - started
    print(f"{Path(path_model).name:<20} {n_params / 1e6:7.1f}M params | open_diloco save {save_s:6.2f} s, "
          f"load {load_s:6.2f} s, {size_of(saved) / 2**20:8.1f} MiB | torch.save {plain_s:6.2f} s, "
          f"{plain.stat().st_size / 2**20:8.1f} MiB | save ratio {save_s / plain_s:5.2f}x, "
          f"size ratio {size_of(saved) / plain.stat().st_size:4.2f}x (includes the outer momentum)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["tests/models/llama-2m-fresh", "configs/models/llama-100m-fresh"])
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for path_model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            bench(path_model, Path(tmp))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
