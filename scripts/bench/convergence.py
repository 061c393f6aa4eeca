"""Convergence of a galaxy against plain data parallelism, simulated in one process (no hivemind, no
torchrun): the quality yardstick of issue 12.

M clusters train one after the other in this process, each with its own model built by ``build_model`` (same
seed), the trainer's AdamW + warm-up/cosine schedule, its own disjoint share of the corpus (``plan_data`` with
galaxy_rank=m, galaxy_size=M) and the trainer's ``inner_step`` / ``evaluate``. Every H inner steps the real
outer step runs: one :class:`open_diloco.outer.diloco.DiLoCo` per cluster, built from an ``HvConfig`` (so an
arm without outer overrides runs the shipped defaults), averaging through the in-process galaxy
(``open_diloco/outer/testing.py``) (the clusters' ``step()`` calls meet in threads). Each round is checked
against a hand-written reference of the outer math (mean Δ, SGD with (Nesterov) momentum, the outer warm-up),
the clusters' data is checked disjoint, the inits identical, and θ_local ← θ_outer checked to reach the model.
Every arm sees the same total tokens.

Arms (``--arms``, space-separated; ``key=value`` after a colon overrides the run's defaults for that arm):

    ddp                  one cluster, batch B (the baseline)
    half:M=2             one cluster, batch B/M (a cluster alone, 1/M of the tokens)
    diloco:M=2,H=20      M clusters of batch B/M, outer step every H inner steps
      keys: M H olr (--hv.outer-lr) mom (--hv.outer-momentum) nest (--hv.outer-nesterov, 0/1)
            owarm (--hv.outer-warmup-rounds) wd (inner weight decay) lr (inner lr)
            reset (1: reset AdamW state each round)
            codec (--hv.compression: int8, int4, int2, sparse, ...) ef (--hv.error-feedback, 0/1)
            density (--hv.sparse-density) rule (--hv.sparse-rule: magnitude, random, cyclic)
            robust (--hv.robust-mean, 0/1)
            P (--hv.fragments) tau (--hv.sync-delay) alpha (--hv.sync-alpha): streaming arms; their outer
            loop runs after every inner step (a fragment lands τ steps after its sync starts), checked for
            identical θ_outer, not against the whole-model reference
            slow: the last cluster at this share of the others' speed (--hv.round-steps by-speed, its
            --hv.cluster-speed): it takes that share of each round's steps, its Δ weighted so; the arm runs
            as many more galaxy steps as keep its total tokens those of M clusters at full speed; its outer
            loop runs after every step, like a streaming arm's
    any kind:
            steps: the arm's inner steps instead of the run's (e.g. a cluster alone for an unequal galaxy's
            wall time: half:M=2,steps=...)

    python scripts/bench/convergence.py --quick               # 2M model, 4 seeds: ~14 min on 2 cores
    python scripts/bench/convergence.py --quick --seeds 0,1   # half of it: ~7 min, a coarser verdict
    python scripts/bench/convergence.py                       # seq 256, B 32, 300 steps, 2 seeds: ~40 min
    python scripts/bench/convergence.py --model 25m --quick   # the ~25M config's quick setting
    python scripts/bench/convergence.py --model 100m --quick --device cuda --lr 1.5e-3   # 96M: a GPU run
    python scripts/bench/convergence.py --arms "ddp diloco:M=2,H=20,olr=0.5,mom=0.8"
    python scripts/bench/convergence.py --quick --arms "ddp diloco:M=2,H=20 diloco:M=2,H=20,codec=int2"

Every arm runs once per seed (``--seeds``; a seed sets the init and the data order, and each seed is a child
process, ``--jobs`` at a time). Prints final val_loss per arm (mean over seeds, and each seed's) and its ratio
to DDP's, taken per seed and averaged, ± its standard error, next to the paper's figure (arXiv 2503.09799).
One seed moves a val_loss by up to ±3 % at the quick size: a single seed cannot tell 1-2 % apart.

Figures, dated, and the outer-settings sweep: docs/results/training-quality.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from convergence_arms import WORLD, make_config, run_arm  # this script's directory is on sys.path
from convergence_report import TARGET, final_val, report

from open_diloco.config import HvConfig
from open_diloco.data import build_eval_loader, plan_data
from open_diloco.model import load_model_config

REPO = Path(__file__).resolve().parents[2]

STDLIB = "/root/.pyenv/versions/3.11.7/lib/python3.11/*.py"
MODELS = {
    "2m": REPO / "tests/models/llama-2m-fresh",
    "25m": REPO / "configs/models/llama-25m-fresh",
    "100m": REPO / "configs/models/llama-100m-fresh",
}
# (seq, DDP batch, steps, arms) per model and size; arms: all see the same total tokens
SETTINGS = {
    ("2m", "quick"): (128, 16, 200, "ddp half:M=2 diloco:M=2,H=20 diloco:M=2,H=50 half:M=4 diloco:M=4,H=20"),
    # the issue-12 setting; ~10 min per arm on one core, so M=4 arms come by --extra-arms
    ("2m", "full"): (256, 32, 300, "ddp half:M=2 diloco:M=2,H=20 diloco:M=2,H=50"),
    ("25m", "quick"): (128, 8, 100, "ddp half:M=2 diloco:M=2,H=20"),
    ("25m", "full"): (128, 16, 200, "ddp half:M=2 diloco:M=2,H=20 diloco:M=2,H=50 diloco:M=4,H=20"),
    # the 96M config (the third size shipped): a GPU run (--device cuda), not timed on 2 cores
    ("100m", "quick"): (
        128,
        16,
        400,
        "ddp half:M=2 diloco:M=2,H=20 diloco:M=2,H=50 half:M=4 diloco:M=4,H=20",
    ),
}
# seeds per setting: one seed moves a val_loss by up to ±3 % at the quick size, so a verdict needs several
SEEDS = {
    ("2m", "quick"): "0,1,2,3",
    ("2m", "full"): "0,1",
    ("25m", "quick"): "0,1",
    ("25m", "full"): "0",
    ("100m", "quick"): "0,1",
}


# None: the shipped default (HvConfig's, or the run's --outer-* flags)
DEFAULT_SPEC = {"M": 1, "H": 0, "olr": None, "mom": None, "nest": None, "owarm": None, "reset": 0}
KEY_TYPES: dict = {
    "M": int,
    "H": int,
    "olr": float,
    "mom": float,
    "nest": int,
    "owarm": int,
    "reset": int,
    "lr": float,
    "wd": float,
    "codec": str,
    "ef": int,
    "density": float,
    "rule": str,
    "robust": int,
    "P": int,
    "tau": int,
    "alpha": float,
    "slow": float,
    "steps": int,
}


def parse_arm(text: str, args) -> tuple[str, dict]:
    kind, _, rest = text.partition(":")
    spec = dict(
        DEFAULT_SPEC,
        olr=args.outer_lr,
        mom=args.outer_momentum,
        nest=args.nesterov,
        owarm=args.outer_warmup_rounds,
        lr=args.lr,
        wd=args.weight_decay,
    )
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in KEY_TYPES:
            raise SystemExit(f"arm {text}: unknown key {key} (known: {', '.join(KEY_TYPES)})")
        spec[key] = value if KEY_TYPES[key] is str else KEY_TYPES[key](float(value))
    if kind == "diloco" and spec["H"] < 1:
        raise SystemExit(f"arm {text}: give H")
    if kind not in ("ddp", "half", "diloco"):
        raise SystemExit(f"arm {text}: kind is ddp, half or diloco")
    return text, spec


def build_parser() -> argparse.ArgumentParser:
    """The bench's flags (the setting's defaults are filled in by :func:`main`)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the quick setting (<= 10 min on 2 cores)")
    parser.add_argument("--model", choices=sorted({m for m, _ in SETTINGS}), default="2m")
    parser.add_argument("--arms", default=None, help="default: the setting's arms (see SETTINGS)")
    parser.add_argument("--extra-arms", default="", help="arms run after the setting's")
    parser.add_argument("--path-model", default=None, help="overrides --model's directory")
    parser.add_argument(
        "--dataset-path",
        default=STDLIB,
        help="a corpus (the trainer's flag), or 'fake' for the fake-data stream",
    )
    parser.add_argument("--data-cache-dir", default=str(REPO / "outputs/data_cache"))
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="DDP's batch; clusters get batch/M")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--outer-lr", type=float, default=None, help="default: --hv.outer-lr's")
    parser.add_argument("--outer-momentum", type=float, default=None, help="default: --hv.outer-momentum's")
    parser.add_argument("--nesterov", type=int, default=None, help="default: --hv.outer-nesterov's")
    parser.add_argument("--outer-warmup-rounds", type=int, default=None, help="default: --hv's")
    parser.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds (init and data order), each a run of every arm; default: the setting's "
        "(SEEDS). Ratios are taken per seed, then averaged: one seed moves val_loss by several %% here",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="seeds run at once, each in a child process (default: one per core; 1: all in this process)",
    )
    parser.add_argument(
        "--eval-samples", type=int, default=128, help="held-out samples per validation (the trainer's flag)"
    )
    parser.add_argument("--eval-batch", type=int, default=16, help="samples per validation forward pass")
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the clusters' models train (cuda: fp32 with TF32 matmuls, seeds run as processes sharing "
        "the GPU); the outer state stays in host memory, as in the trainer",
    )
    parser.add_argument("--out", default=None, help="JSON lines, one per arm and seed")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a galaxy arm misses its target (TARGET ratio to DDP, below the 1/M-token cluster)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="the ratio to DDP every galaxy arm must meet (default: TARGET)",
    )
    parser.add_argument(
        "--ddp-val", type=float, default=None, help="DDP's final val_loss when no ddp arm runs (every seed)"
    )
    parser.add_argument("--half-val", type=float, default=None, help="a half arm's final val_loss, ditto")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    if (args.model, size) not in SETTINGS:
        parser.error(f"--model {args.model} has no {size} setting: add --quick")
    seq, batch, steps, arms = SETTINGS[(args.model, size)]
    for key, value in (("seq_length", seq), ("batch", batch), ("steps", steps), ("arms", arms)):
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.arms = f"{args.arms} {args.extra_arms}".strip()
    args.path_model = args.path_model or str(MODELS[args.model])
    if args.dataset_path == "fake":
        args.dataset_path = None  # the trainer's --fake-data: each cluster its own stream
    seeds = [int(seed) for seed in (args.seeds or SEEDS[(args.model, size)]).split(",")]
    arms = [parse_arm(text, args) for text in args.arms.split()]  # bad arms fail before any run starts
    if len(seeds) == 1 or args.jobs == 1:  # in this process, one seed after another
        results = [record for seed in seeds for record in run_seed(args, arms, seed, args.out)]
    else:
        results = run_seeds_in_processes(seeds, args.jobs or min(len(seeds), os.cpu_count() or 1))
        if args.out:
            append_records(args.out, results)
    targets = dict.fromkeys(TARGET, args.target) if args.target else TARGET
    missed = report(results, args.steps, args.ddp_val, args.half_val, targets)
    if args.check and missed:
        raise SystemExit(f"quality yardstick: {', '.join(missed)} missed the target (see the table)")


def append_records(path: str, records: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


def run_seed(
    args: argparse.Namespace, arms: list[tuple[str, dict]], seed: int, out: str | None
) -> list[dict]:
    """Every arm with one seed, in this process; each arm's record goes to ``out`` as soon as it is done, so a
    long run that dies keeps the arms it finished."""
    args.seed = seed
    torch.set_num_threads(args.threads)
    WORLD.device = torch.device(args.device)
    if WORLD.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    eval_plan = plan_data(
        make_config(args, args.eval_batch, args.lr, args.weight_decay),
        load_model_config(args.path_model).vocab_size,
        1,
        0,
        1,
    )
    eval_loader = build_eval_loader(
        eval_plan, per_device_batch=args.eval_batch, rank=0, world_size=1, samples=args.eval_samples
    )
    if eval_plan.val_ids is not None and args.eval_samples > len(eval_plan.val_ids):
        print(f"note: validation reads {args.eval_samples} samples of {len(eval_plan.val_ids)}")
    defaults = HvConfig()
    print(
        f"{time.strftime('%Y-%m-%d')}: model {args.path_model}; "
        f"{f'corpus {eval_plan.corpus.num_tokens} tokens' if eval_plan.corpus else 'fake data'}; "
        f"seq {args.seq_length}, DDP batch {args.batch}, {args.steps} steps, lr {args.lr}, "
        f"wd {args.weight_decay}, warm-up {args.warmup_steps}, seed {seed}; shipped outer: lr "
        f"{defaults.outer_lr}, momentum {defaults.outer_momentum}, nesterov {defaults.outer_nesterov}, "
        f"warm-up rounds {defaults.outer_warmup_rounds}",
        flush=True,
    )
    results = []
    for name, spec in arms:
        results.append(dict(run_arm(args, name, spec, eval_loader), seed=seed))
        if out:
            append_records(out, results[-1:])
    return results


def run_seeds_in_processes(seeds: list[int], jobs: int) -> list[dict]:
    """One child process of this script per seed (``jobs`` at a time), each with this run's arguments; their
    progress goes to a log per seed, whose tail is printed if a child fails."""
    own = [a for a in sys.argv[1:] if not a.startswith(("--seeds=", "--jobs=", "--out="))]
    for flag in ("--seeds", "--jobs", "--out"):  # drop "--flag value" pairs
        while flag in own:
            at = own.index(flag)
            del own[at : at + 2]
    workdir = Path(tempfile.mkdtemp(prefix="convergence-"))
    print(f"{len(seeds)} seeds, {jobs} at a time; progress of each in {workdir}/seed*.log", flush=True)
    pending, running, results = list(seeds), {}, []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                seed = pending.pop(0)
                log = open(workdir / f"seed{seed}.log", "w")
                command = [
                    sys.executable,
                    __file__,
                    *own,
                    "--seeds",
                    str(seed),
                    "--out",
                    str(workdir / f"seed{seed}.jsonl"),
                ]
                running[seed] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log)
            time.sleep(1)
            for seed, (child, log) in list(running.items()):
                if child.poll() is None:
                    continue
                log.close()
                del running[seed]
                if child.returncode:
                    tail = (workdir / f"seed{seed}.log").read_text().splitlines()[-15:]
                    raise SystemExit(f"seed {seed} failed (exit {child.returncode}):\n" + "\n".join(tail))
                records = [json.loads(line) for line in open(workdir / f"seed{seed}.jsonl")]
                results.extend(records)
                print(
                    f"seed {seed} done: " + ", ".join(f"{r['arm']} {final_val(r):.4f}" for r in records),
                    flush=True,
                )
    finally:
        for child, _ in running.values():
            child.kill()
            child.wait()
    return results


if __name__ == "__main__":
    main()
