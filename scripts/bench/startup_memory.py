"""Host memory and seconds from start to the first inner step, per rank: the old build (the whole model on
every rank, then sharded) against the meta-device build (sharded on ``meta``, each rank materialising only its
shards), one after the other in the same run, same flags.

    python scripts/bench/startup_memory.py                                   # 100M config, 2 ranks, CPU
    python scripts/bench/startup_memory.py --path-model configs/models/llama-1b-fresh --no-step

Each build runs under torchrun (gloo, CPU). Per rank: RSS before the build (the constant: interpreter, torch,
transformers, process group), the peak RSS once the model is materialised ("start"), and, unless --no-step,
the peak through one inner step (AdamW, random tokens) and the seconds to it. The meta build's start peak is
checked against its shard + the largest parameter + the constant; the old build's against the whole model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
BUILDS = ("old", "meta")


def build_full_then_shard(config, world, precision: str):
    """The build before the meta device (kept for this bench): the whole model in fp32 on every rank,
    initialised by transformers under ``torch.manual_seed``, then sharded and moved."""
    import torch
    from transformers import AutoModelForCausalLM

    from open_diloco.model import load_model_config
    from open_diloco.parallelize import parallelize

    model_config = load_model_config(config.path_model)
    model_config.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    return parallelize(model, world.device, precision, config.activation_checkpointing, config.torch_compile)


def worker(args: argparse.Namespace) -> None:
    """One rank of one build: measure, then rank 0 prints every rank's figures as one JSON line."""
    import psutil
    import torch.distributed as dist

    from open_diloco.config import Config
    from open_diloco.dry_run import random_batches
    from open_diloco.optim import build_inner_optimizer
    from open_diloco.outer.state import local_shards
    from open_diloco.steps import inner_step
    from open_diloco.trainer import build_sharded_model
    from open_diloco.world import describe_world, join_process_group, leave_process_group

    world = describe_world("cpu", "gloo")
    join_process_group(world)
    config = Config(
        path_model=Path(args.path_model),
        fake_data=True,
        torch_compile=False,
        activation_checkpointing=True,
        seq_length=args.seq_length,
        per_device_train_batch_size=1,
        total_batch_size=world.world_size,
    )
    dist.barrier()
    rss_before, started = psutil.Process().memory_info().rss, time.perf_counter()
    build = build_sharded_model if args.worker == "meta" else build_full_then_shard
    model = build(config, world, "32-true")
    figures = {
        "rss_before": rss_before,
        "peak_start": _peak_rss(),
        "seconds_start": time.perf_counter() - started,
        "shard_bytes": 4 * sum(shard.numel() for shard in local_shards(model)),
        "largest_param_bytes": 4 * max(param.numel() for param in model.parameters()),
        "model_bytes": 4 * sum(param.numel() for param in model.parameters()),
    }
    if not args.no_step:
        optimizer = build_inner_optimizer(model, 1e-4, 0.1, (0.9, 0.95))
        batches = random_batches(model.config.vocab_size, config, seed=world.rank)
        inner_step(model, optimizer, batches, 1, 1.0, world)
        figures.update(peak_step=_peak_rss(), seconds_step=time.perf_counter() - started)
    ranks = [None] * world.world_size
    dist.all_gather_object(ranks, figures)
    if world.rank == 0:
        print(json.dumps({"build": args.worker, "ranks": ranks}), flush=True)
    leave_process_group(synchronize=True)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_build(build: str, args: argparse.Namespace) -> list[dict]:
    """Every rank's figures of one build, from a torchrun of this script."""
    from open_diloco.local_galaxy import TORCHRUN, trainer_env

    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={args.nproc}", __file__, "--worker", build]
    cmd += ["--path-model", args.path_model, "--seq-length", str(args.seq_length)]
    cmd += ["--no-step"] if args.no_step else []
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{build} build failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith('{"build"'))
    return json.loads(line)["ranks"]


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """A table per build and rank, the ratios old / meta of the worst rank, and the meta build's bound."""
    print(f"{args.path_model}, {args.nproc} ranks, CPU (gloo), fp32, seq {args.seq_length} x 1 per rank")
    step = "" if args.no_step else " | peak RSS after step | s to first step"
    print(f"build | rank | RSS before | peak RSS at start | s to start{step}")
    for build, ranks in results.items():
        for rank, fig in enumerate(ranks):
            line = (
                f"{build} | {rank} | {fig['rss_before'] / MIB:,.0f} MiB | {fig['peak_start'] / MIB:,.0f} MiB"
            )
            line += f" | {fig['seconds_start']:.1f}"
            if not args.no_step:
                line += f" | {fig['peak_step'] / MIB:,.0f} MiB | {fig['seconds_step']:.1f}"
            print(line)
    keys = ["peak_start", "seconds_start"] + ([] if args.no_step else ["peak_step", "seconds_step"])
    for key in keys:
        old, meta = (max(fig[key] for fig in results[build]) for build in BUILDS)
        print(f"old / meta, {key} (worst rank): {old / meta:.2f}")
    old, meta = (max(fig["peak_start"] - fig["rss_before"] for fig in results[build]) for build in BUILDS)
    print(f"old / meta, peak_start - RSS before (worst rank): {old / meta:.2f}")
    for fig in results["meta"]:
        grown, bound = fig["peak_start"] - fig["rss_before"], fig["shard_bytes"] + fig["largest_param_bytes"]
        shard, largest = fig["shard_bytes"] / MIB, fig["largest_param_bytes"] / MIB
        print(
            f"meta: start peak - RSS before = {grown / MIB:,.0f} MiB, "
            f"{'within' if grown <= bound else 'ABOVE'} shard {shard:,.0f} + largest parameter "
            f"{largest:,.0f} MiB (whole model {fig['model_bytes'] / MIB:,.0f} MiB)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path-model", default="configs/models/llama-100m-fresh")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--no-step", action="store_true", help="measure the build only (no inner step)")
    parser.add_argument("--worker", choices=BUILDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    report({build: run_build(build, args) for build in BUILDS}, args)


if __name__ == "__main__":
    main()
