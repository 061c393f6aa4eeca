"""Throughput of the trainer on real data vs fake data, measured in the same run (target ratio >= 0.95).

Real data is read from a packed corpus (a memmap slice per sample), so it should cost no more than generating
fake samples. The corpus is packed before timing (packing happens once per corpus, not per run); runs
alternate fake / real so a shared machine's noise hits both alike. Each run's figure is the median tokens/s of
its steps after the warm-up.

    python scripts/bench/data_loading.py                       # stdlib sources as the corpus, 2 ranks
    python scripts/bench/data_loading.py --dataset-path DIR --nproc 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]


def corpus_from_stdlib(out: Path, count: int) -> Path:
    """A text corpus every machine has: the standard library's own sources."""
    out.mkdir(parents=True, exist_ok=True)
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]:
        shutil.copyfile(source, out / source.name)
    return out


def run_trainer(args: argparse.Namespace, work: Path, data_flags: list[str], name: str) -> float:
    """Median tokens/s of one trainer run after ``--warmup`` steps."""
    metrics = work / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        str(REPO / "open_diloco" / "train_fsdp.py"),
        "--path-model",
        str(REPO / "tests/models/llama-2m-fresh"),
        "--no-torch-compile",
        "--seq-length",
        str(args.seq_length),
        "--per-device-train-batch-size",
        str(args.per_device_batch),
        "--total-batch-size",
        str(args.per_device_batch * args.nproc),
        "--max-steps",
        str(args.steps),
        "--num-workers",
        str(args.num_workers),
        "--log-interval",
        str(args.steps),
        "--metric-logger-type",
        "jsonl",
        "--metrics-path",
        str(metrics),
        *data_flags,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"{name} run failed:\n{done.stderr[-2000:]}")
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r]
    return statistics.median(r["tokens_per_second"] for r in records[args.warmup :])


def loader_alone(packed: Path, args: argparse.Namespace, batches: int = 300) -> dict[str, float]:
    """Samples/s the loaders alone produce (in-process, no model): the headroom real data leaves the
    trainer."""
    sys.path.insert(0, str(REPO))
    from open_diloco.config import Config
    from open_diloco.data import build_train_loader, plan_data

    rates = {}
    for name, flags in (("fake", {"fake_data": True}), ("real", {"dataset_path": str(packed)})):
        config = Config(
            seq_length=args.seq_length,
            per_device_train_batch_size=args.per_device_batch,
            total_batch_size=args.per_device_batch,
            **flags,
        )
        plan = plan_data(config, 2048, world_size=1, galaxy_rank=0, galaxy_size=1)
        stream = iter(
            build_train_loader(
                plan, per_device_batch=args.per_device_batch, rank=0, world_size=1, num_workers=0
            )
        )
        next(stream)
        started = time.perf_counter()
        for _ in range(batches):
            next(stream)
        rates[name] = batches * args.per_device_batch / (time.perf_counter() - started)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset-path", help="raw or packed corpus (default: stdlib sources)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=1)
    args = parser.parse_args()

    console = Console()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        dataset = args.dataset_path or str(corpus_from_stdlib(work / "corpus", 300))
        packed = work / "packed"
        subprocess.run(
            [
                sys.executable,
                str(REPO / "open_diloco" / "train_fsdp.py"),
                "prepare-data",
                dataset,
                str(packed),
            ],
            check=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        rates = loader_alone(packed, args)
        console.print(
            f"loader alone (1 process, no workers): fake {rates['fake']:,.0f} samples/s, "
            f"real {rates['real']:,.0f} samples/s"
        )
        fake, real = [], []
        for repeat in range(args.repeats):
            fake.append(run_trainer(args, work, ["--fake-data"], f"fake{repeat}"))
            real.append(run_trainer(args, work, ["--dataset-path", str(packed)], f"real{repeat}"))
            console.print(f"repeat {repeat}: fake {fake[-1]:,.0f} tok/s, real {real[-1]:,.0f} tok/s")

    table = Table(
        title=f"trainer throughput, 2M model, {args.nproc} rank(s), seq {args.seq_length}, "
        f"batch {args.per_device_batch}/rank, {args.num_workers} worker(s)"
    )
    for column in ("data", "median tok/s per run", "median of runs"):
        table.add_column(column)
    for name, values in (("fake", fake), ("real (packed memmap)", real)):
        table.add_row(name, ", ".join(f"{v:,.0f}" for v in values), f"{statistics.median(values):,.0f}")
    console.print(table)
    ratio = statistics.median(real) / statistics.median(fake)
    console.print(f"real / fake trainer throughput (median of runs): [bold]{ratio:.3f}[/] (target >= 0.95)")


if __name__ == "__main__":
    main()
