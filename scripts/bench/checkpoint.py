"""Checkpoint cost, measured in one run against baselines of the same run:

- save (staged and written, waited for), load and size of an open_diloco checkpoint (DCP, sharded, atomic,
  with the outer momentum) vs a plain `torch.save` of the same model + optimizer state;
- what a save costs the galaxy: the wall time of a round (H inner steps + the outer step, i.e. until this
  cluster is ready for the galaxy's next all-reduce) with no save, with a save that blocks until written (what
  the trainer did before saves went to the background), and with the trainer's background save, whose write
  overlaps the round's inner steps; plus how long training paused for the save. Arms alternate, medians.

    python scripts/bench/checkpoint.py                       # 2M and ~100M models, one process on CPU
    python scripts/bench/checkpoint.py configs/models/llama-100m-fresh --rounds 3 --local-steps 4
"""

from __future__ import annotations

import argparse
import statistics
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
from open_diloco.outer.testing import InProcessGalaxy
from open_diloco.parallelize import parallelize

ARMS = ("no save", "blocking save", "background save")


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def build(path_model: str, device: torch.device, precision: str):
    model = parallelize(build_model(Path(path_model), seed=0), device, precision, False, False)
    optimizer = build_inner_optimizer(model, 1e-4, 0.1, (0.9, 0.95))
    numel = sum(p.numel() for p in model.parameters())
    hv = HvConfig(local_steps=1, outer_lr=0.7, outer_momentum=0.9)
    outer = DiLoCo(model, InProcessGalaxy(1).averager(0, numel), hv, warn=lambda *_: None)
    return model, optimizer, outer


def inner_step(model, optimizer, batch: int, seq: int, device: torch.device) -> None:
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_save_load(path_model: str, workdir: Path, device: torch.device, precision: str) -> None:
    model, optimizer, outer = build(path_model, device, precision)
    inner_step(model, optimizer, 1, 16, device)
    outer.step()  # creates the momentum buffer
    n_params = sum(p.numel() for p in model.parameters())
    saver = checkpoint.CheckpointSaver(workdir / "ckpt", 1, {}, model.config.to_dict())

    started = time.perf_counter()
    saver.start(1, model=model, optimizer=optimizer, outer=outer)
    saved = saver.wait()
    save_s = time.perf_counter() - started
    started = time.perf_counter()
    checkpoint.load(saved, checkpoint.read_metadata(saved), model=model, optimizer=optimizer, outer=outer)
    load_s = time.perf_counter() - started
    saver.close(timeout=0)

    started = time.perf_counter()
    plain = workdir / "plain.pt"
    torch.save(
        {
            "model": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "optim": optimizer.state_dict(),
        },
        plain,
    )
    plain_s = time.perf_counter() - started
    print(
        f"{Path(path_model).name:<20} {n_params / 1e6:7.1f}M params | open_diloco save {save_s:6.2f} s, "
        f"load {load_s:6.2f} s, {size_of(saved) / 2**20:8.1f} MiB | torch.save {plain_s:6.2f} s, "
        f"{plain.stat().st_size / 2**20:8.1f} MiB | save ratio {save_s / plain_s:5.2f}x, "
        f"size ratio {size_of(saved) / plain.stat().st_size:4.2f}x (includes the outer momentum)",
        flush=True,
    )


def bench_rounds(path_model: str, workdir: Path, device: torch.device, precision: str, args) -> None:
    """Round wall time with no save, a blocking save and a background save at the round's start (where the
    trainer saves: right after an outer step)."""
    model, optimizer, outer = build(path_model, device, precision)
    saver = checkpoint.CheckpointSaver(workdir / "rounds", 1, {}, model.config.to_dict())
    inner_step(model, optimizer, args.batch, args.seq, device)  # warm-up: optimizer state, allocator
    outer.step()
    rounds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    paused: dict[str, list[float]] = {arm: [] for arm in ARMS}
    written_in_round: list[bool] = []
    step = 0
    for _ in range(args.rounds):
        for arm in ARMS:
            sync(device)
            started = time.perf_counter()
            if arm != "no save":
                step += 1
                saver.start(step, model=model, optimizer=optimizer, outer=outer)
                if arm == "blocking save":
                    saver.wait()
            paused[arm].append(time.perf_counter() - started)
            for _ in range(args.local_steps):
                inner_step(model, optimizer, args.batch, args.seq, device)
            outer.step()
            sync(device)
            rounds[arm].append(time.perf_counter() - started)
            if arm == "background save":
                # the trainer waits for a save only at the next save; here the next arm must not overlap it
                written_in_round.append(not saver.writing)
                saver.wait()
    saver.close(timeout=0)
    print(
        f"  background saves written before their round ended: {sum(written_in_round)} of "
        f"{len(written_in_round)}"
    )
    base = statistics.median(rounds["no save"])
    print(
        f"{Path(path_model).name}: round = {args.local_steps} inner steps (batch {args.batch} x seq "
        f"{args.seq}) + outer step, {device.type}, {precision}; medians of {args.rounds}"
    )
    for arm in ARMS:
        median = statistics.median(rounds[arm])
        print(
            f"  {arm:<16} round {median:7.2f} s ({median / base:5.2f}x no save) | training paused "
            f"{statistics.median(paused[arm]):6.2f} s | rounds {', '.join(f'{r:.2f}' for r in rounds[arm])}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "models", nargs="*", default=["tests/models/llama-2m-fresh", "configs/models/llama-100m-fresh"]
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per arm")
    parser.add_argument("--local-steps", type=int, default=4, help="H: inner steps per round")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-save-load", action="store_true", help="only the round times")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    for path_model in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            if not args.skip_save_load:
                bench_save_load(path_model, Path(tmp), device, precision)
            bench_rounds(path_model, Path(tmp), device, precision, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
