"""Inner-loop throughput: open_diloco's trainer vs a minimal plain FSDP2 loop (scripts/bench/plain_fsdp.py),
same model, batch, precision and rank count, measured alternately in the same run.

    python scripts/bench/inner_loop.py                      # CPU, 2 ranks, 2M model
    python scripts/bench/inner_loop.py --nproc 1 --path-model configs/models/llama-100m-fresh \\
        --precision bf16-mixed --torch-compile --seq-length 1024 --per-device 16 --total 64   # one GPU

Prints the median tokens/s of each and the ratio trainer / plain (target ≥ 0.98), and each run's 10th-90th
percentile step rate (a wide spread is a stall in some steps, not a slower step). ``--loops`` adds variants
that take the difference apart: the plain loop with the trainer's model build and tokens, the trainer with
Python's automatic garbage collection (``--gc-interval 0``) or with its data read in-process.
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


# name -> (script, its extra flags); the ratios are to the first loop of --loops
LOOPS = {
    "plain": ("scripts/bench/plain_fsdp.py", []),
    "plain-like-trainer": ("scripts/bench/plain_fsdp.py", ["--like-trainer"]),
    "trainer": ("open_diloco/train_fsdp.py", []),
    "trainer-gc-auto": ("open_diloco/train_fsdp.py", ["--gc-interval", "0"]),
    "trainer-no-workers": ("open_diloco/train_fsdp.py", ["--num-workers", "0"]),
}


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
    parser.add_argument(
        "--loops",
        default="plain trainer",
        help=f"which loops to time, space-separated, the first is the baseline: {' '.join(LOOPS)}",
    )
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
    loops = args.loops.split()
    unknown = [name for name in loops if name not in LOOPS]
    if unknown:
        sys.exit(f"--loops: unknown {' '.join(unknown)}; choose from {' '.join(LOOPS)}")
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in loops}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in loops:
                script, extra = LOOPS[name]
                if script.endswith("plain_fsdp.py"):
                    out = run(
                        [*torchrun, script, *shared, "--warmup", str(args.warmup), *compile_flag, *extra]
                    )
                    result = json.loads(out.strip().splitlines()[-1])
                    runs[name].append((result["tokens_per_second"], result["p10"], result["p90"]))
                    continue
                metrics = Path(tmp) / f"{name}{repeat}.jsonl"
                run(
                    [
                        *torchrun,
                        script,
                        *shared,
                        "--fake-data",
                        "--metric-logger-type",
                        "jsonl",
                        "--metrics-path",
                        str(metrics),
                        "--warmup-steps",
                        "0",
                        *(compile_flag or ["--no-torch-compile"]),
                        *extra,
                    ]
                )
                records = [json.loads(line) for line in metrics.read_text().splitlines()]
                rates = [r["tokens_per_second"] for r in records if r.get("step", 0) > args.warmup]
                deciles = statistics.quantiles(rates, n=10)
                runs[name].append((statistics.median(rates), deciles[0], deciles[-1]))
    print(
        f"setup: {args.nproc} rank(s), {args.path_model}, seq {args.seq_length}, batch {args.per_device}x"
        f"{args.nproc} (total {args.total}), {args.precision}, compile={args.torch_compile}, "
        f"{args.steps} steps ({args.warmup} warm-up) x {args.repeats} runs"
    )
    median = {name: statistics.median(rate for rate, _, _ in results) for name, results in runs.items()}
    for name, results in runs.items():
        spread = ", ".join(f"{rate:.0f} [{p10:.0f}-{p90:.0f}]" for rate, p10, p90 in results)
        print(f"{name:<20}: {median[name]:12.0f} tokens/s  (runs, median [p10-p90]: {spread})")
    for name in loops[1:]:
        print(f"ratio {name} / {loops[0]}: {median[name] / median[loops[0]]:.3f}  (target >= 0.98)")


if __name__ == "__main__":
    main()
