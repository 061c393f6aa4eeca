"""Inner-loop throughput: open_diloco's trainer vs a minimal plain FSDP2 loop (scripts/bench/plain_fsdp.py),
same model, batch, precision and rank count, measured alternately in the same run.

    python scripts/bench/inner_loop.py                      # CPU, 2 ranks, 2M model
    python scripts/bench/inner_loop.py --nproc 1 --path-model configs/models/llama-100m-fresh \\
        --precision bf16-mixed --torch-compile --seq-length 1024 --per-device 16 --total 64   # one GPU

Prints the median tokens/s of each and the ratio trainer / plain (target ≥ 0.98).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"benchmark command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc.stdout


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--path-model", default="tests/models/llama-2m-fresh")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--per-device", type=int, default=4)
    parser.add_argument("--total", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--torch-compile", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
    ]
    shared = [
        "--path-model",
        args.path_model,
        "--per-device-train-batch-size",
        str(args.per_device),
        "--total-batch-size",
        str(args.total),
        "--seq-length",
        str(args.seq_length),
        "--max-steps",
        str(args.steps),
        "--precision",
        args.precision,
    ]
    compile_flag = ["--torch-compile"] if args.torch_compile else []
    trainer_rates, plain_rates = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            metrics = Path(tmp) / f"trainer{repeat}.jsonl"
            run(
                [
                    *torchrun,
                    "open_diloco/train_fsdp.py",
                    *shared,
                    "--fake-data",
                    "--metric-logger-type",
                    "jsonl",
                    "--metrics-path",
                    str(metrics),
                    "--warmup-steps",
                    "0",
                    *(compile_flag or ["--no-torch-compile"]),
                ]
            )
            records = [json.loads(line) for line in metrics.read_text().splitlines()]
            rates = [r["tokens_per_second"] for r in records if r.get("step", 0) > args.warmup]
            trainer_rates.append(statistics.median(rates))
            out = run(
                [
                    *torchrun,
                    "scripts/bench/plain_fsdp.py",
                    *shared,
                    "--warmup",
                    str(args.warmup),
                    *compile_flag,
                ]
            )
            plain_rates.append(json.loads(out.strip().splitlines()[-1])["tokens_per_second"])
    trainer, plain = statistics.median(trainer_rates), statistics.median(plain_rates)
    print(
        f"setup: {args.nproc} rank(s), {args.path_model}, seq {args.seq_length}, batch {args.per_device}x"
        f"{args.nproc} (total {args.total}), {args.precision}, compile={args.torch_compile}"
    )
    print(f"plain FSDP2 loop : {plain:12.0f} tokens/s  (runs: {', '.join(f'{r:.0f}' for r in plain_rates)})")
    print(
        f"open_diloco      : {trainer:12.0f} tokens/s  (runs: {', '.join(f'{r:.0f}' for r in trainer_rates)})"
    )
    print(f"ratio trainer/plain: {trainer / plain:.3f}  (target >= 0.98)")


if __name__ == "__main__":
    main()
