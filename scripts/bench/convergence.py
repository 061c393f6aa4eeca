"""Convergence of a galaxy against plain data parallelism, simulated in one process (no hivemind, no torchrun).

M clusters train one after the other in this process, each with its own model built by ``build_model`` (same
seed), the trainer's AdamW + warm-up/cosine schedule, its own disjoint share of the corpus (``plan_data`` with
galaxy_rank=m, galaxy_size=M) and the trainer's ``inner_step`` / ``evaluate``. Every H inner steps the real
outer step runs: one :class:`open_diloco.diloco.DiLoCo` per cluster, averaging through an in-process averager
(the clusters' ``step()`` calls meet in threads). Each round is checked against a hand-written reference of the
outer math (mean Δ, SGD with Nesterov momentum), the clusters' data is checked disjoint, the inits identical,
and θ_local ← θ_outer checked to reach the model.

Arms (``--arms``, space-separated; ``key=value`` after a colon overrides the run's defaults for that arm):

    ddp                  one cluster, batch B (the baseline)
    half:M=2             one cluster, batch B/M (a cluster alone)
    diloco:M=2,H=20      M clusters of batch B/M, outer step every H inner steps
      keys: M H olr (outer lr) mom (outer momentum) nest (0/1) wd (inner weight decay) lr (inner lr)
            owarm (outer-lr warm-up: rounds over which outer lr and momentum ramp from plain averaging)
            avg1 (1: round 1 is plain averaging, no momentum from it)  reset (1: reset AdamW state each round)

    python scripts/bench/convergence.py --quick            # ~10 min on 2 CPU cores, 2M model
    python scripts/bench/convergence.py                    # the issue-12 setting (seq 256, B 32, 300 steps)
    python scripts/bench/convergence.py --arms "ddp diloco:M=2,H=20,olr=0.5,mom=0.8"

Prints final val_loss per arm and its ratio to DDP's, next to the paper's figure (arXiv 2503.09799).

Measured (--quick: 2M model, CPython stdlib sources, seq 128, DDP batch 16, 200 steps, lr 3e-3, seed 0), val_loss
and ratio to DDP: ddp 2.296 | half:M=2 2.374 (1.034) | diloco M=2 H=20 shipped 0.7/0.9 2.671 (1.163) | H=5
shipped 2.737 (1.192) | H=20 avg1 0.7/0.9 2.597 at step 150 (shipped 2.715) | H=20 olr 1 mom 0.5 avg1 2.486
(1.083) | H=50 same 2.433 (1.060) | H=20 plain averaging 2.397 (1.044) | H=20 plain, wd 0 2.401 (ddp wd 0: 2.302)
| H=5 plain averaging 2.348 (1.023).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from open_diloco.config import Config
from open_diloco.data import build_eval_loader, build_train_loader, plan_data
from open_diloco.diloco import DiLoCo, RoundReport, fingerprint_bytes, local_shards
from open_diloco.model import build_model, load_model_config
from open_diloco.optim import build_inner_optimizer, build_scheduler
from open_diloco.trainer import evaluate, inner_step, position_at

REPO = Path(__file__).resolve().parents[2]
STDLIB = "/root/.pyenv/versions/3.11.7/lib/python3.11/*.py"
PAPER = {  # arXiv 2503.09799 at 35M, H=30, as quoted in issue 12 (ratio of final loss to DDP's)
    1: "M=1 beats DDP",
    2: "+0.7% (35M)",
}
TARGET = {2: 1.02, 4: 1.04}


class LockstepGalaxy:
    """Averages the clusters' buffers: each cluster's ``DiLoCo.step`` runs in its own thread and meets here."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.buffers: dict[int, torch.Tensor] = {}
        self.meta: dict[int, dict] = {}

    def averager(self, rank: int) -> LockstepAverager:
        return LockstepAverager(self, rank)


class LockstepAverager:
    def __init__(self, galaxy: LockstepGalaxy, rank: int):
        self.galaxy, self.rank = galaxy, rank

    def all_reduce(self, buffer, round_id, fingerprint):
        galaxy = self.galaxy
        galaxy.buffers[self.rank] = buffer.clone()
        galaxy.meta[self.rank] = {"galaxy_rank": self.rank, "round_id": round_id, **fingerprint}
        galaxy.barrier.wait(600)
        average = torch.stack([galaxy.buffers[r] for r in range(galaxy.size)]).mean(0)
        peers = dict(galaxy.meta)
        galaxy.barrier.wait(600)
        buffer.copy_(average)
        return RoundReport(group_size=galaxy.size, complete=True, peers=peers)

    def serve_state(self, get_state):
        pass

    def download_state(self, timeout):
        return None

    def shutdown(self):
        pass


def make_config(args: argparse.Namespace, batch: int, lr: float, wd: float) -> Config:
    return Config(
        path_model=Path(args.path_model),
        seq_length=args.seq_length,
        per_device_train_batch_size=batch,
        total_batch_size=batch,
        lr=lr,
        warmup_steps=args.warmup_steps,
        total_steps=args.steps,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=wd,
        max_steps=args.steps,
        seed=args.seed,
        dataset_path=args.dataset_path,
        data_cache_dir=Path(args.data_cache_dir),
        num_workers=0,
        eval_steps=args.eval_steps,
        precision="32-true",
        torch_compile=False,
        device="cpu",
    )


WORLD = SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0, is_main=True)


class Cluster:
    """One cluster: model, inner optimizer, schedule and its share of the data, as the trainer sets them up."""

    def __init__(self, args, spec, rank: int, size: int, batch: int):
        config = make_config(args, batch, spec["lr"], spec["wd"])
        vocab = load_model_config(config.path_model).vocab_size
        self.plan = plan_data(config, vocab, 1, rank, size)
        self.model = build_model(config.path_model, config.seed)
        self.model.train()
        self.model.set_requires_gradient_sync = lambda flag: None  # what FSDP2 offers; a no-op unsharded
        self.optimizer = build_inner_optimizer(self.model, config.lr, config.weight_decay, config.adam_betas)
        self.scheduler = build_scheduler(
            self.optimizer, config.warmup_steps, config.schedule_steps, config.min_lr_ratio
        )
        loader = build_train_loader(self.plan, per_device_batch=batch, rank=0, world_size=1, num_workers=0)
        self.batches = self._recording(position_at(0, loader, self.scheduler, 1))
        self.seen: list[int] = []
        self.max_grad_norm = config.max_grad_norm

    def _recording(self, batches):
        for batch in batches:
            self.seen.extend(int(i) for i in batch["sample_id"])
            yield batch

    def step(self) -> float:
        loss, _ = inner_step(self.model, self.optimizer, self.batches, 1, self.max_grad_norm, WORLD)
        self.scheduler.step()
        return loss


class ReferenceOuter:
    """The outer step written out by hand: θ ← θ − lr·(g + μ·b) with b ← μ·b + g, g = mean Δ (torch's SGD)."""

    def __init__(self, theta: torch.Tensor):
        self.theta = theta.clone().double()
        self.buf: torch.Tensor | None = None

    def step(self, locals_: list[torch.Tensor], lr: float, momentum: float, nesterov: bool) -> None:
        grad = torch.stack([self.theta - t.double() for t in locals_]).mean(0)
        if momentum:
            self.buf = grad.clone() if self.buf is None else self.buf.mul(momentum).add(grad)
            grad = grad + momentum * self.buf if nesterov else self.buf
        self.theta -= lr * grad


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([s.reshape(-1) for s in local_shards(model)]).detach().clone()


def outer_hparams(spec: dict, round_index: int) -> tuple[float, float]:
    """(outer lr, outer momentum) of round ``round_index`` (1-based) under the arm's warm-up options."""
    lr, mom = spec["olr"], spec["mom"]
    if spec["avg1"] and round_index == 1:
        return 1.0, 0.0
    if spec["owarm"]:
        frac = min(1.0, round_index / spec["owarm"])
        # from plain averaging (lr 1, no momentum) towards the target, keeping the effective step lr/(1−μ) smooth
        return 1.0 + frac * (lr - 1.0), frac * mom
    return lr, mom


def run_arm(args, name: str, spec: dict, eval_loader) -> dict:
    size, local_steps = spec["M"], spec["H"]
    galaxy = name.startswith("diloco")
    batch = args.batch // size if (galaxy or name.startswith("half")) else args.batch
    clusters = [Cluster(args, spec, m, size if galaxy else 1, batch) for m in range(size if galaxy else 1)]
    record: dict = {
        "arm": name,
        "spec": spec,
        "batch_per_cluster": batch,
        "val": {},
        "loss": [],
        "rounds": [],
    }
    if galaxy:
        hashes = {fingerprint_bytes(flat(c.model)) for c in clusters}
        assert len(hashes) == 1, "clusters start from different weights"
        lockstep = LockstepGalaxy(size)
        outers = [
            DiLoCo(
                c.model,
                lockstep.averager(m),
                local_steps=local_steps,
                outer_lr=spec["olr"],
                outer_momentum=max(spec["mom"], 1e-12),
                galaxy_rank=m,
                galaxy_size=size,
                on_partial_round="proceed",
                warn=print,
            )
            for m, c in enumerate(clusters)
        ]
        for outer in outers:  # the outer optimizer the arm asks for (torch SGD, as DiLoCo builds it)
            outer.outer_optimizer = torch.optim.SGD(
                [outer.outer_params],
                lr=spec["olr"],
                momentum=max(spec["mom"], 1e-12),
                nesterov=bool(spec["nest"]),
            )
        reference = ReferenceOuter(outers[0].outer_params.detach())
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        losses = [c.step() for c in clusters]
        record["loss"].append(sum(losses) / len(losses))
        if galaxy and step % local_steps == 0:
            round_index = step // local_steps
            lr, mom = outer_hparams(spec, round_index)
            locals_ = [flat(c.model) for c in clusters]
            for outer in outers:
                group = outer.outer_optimizer.param_groups[0]
                group["lr"], group["momentum"] = lr, mom
            results: list = [None] * size
            threads = [
                threading.Thread(target=lambda m=m, results=results: results.__setitem__(m, outers[m].step()))
                for m in range(size)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            reference.step(locals_, lr, mom, bool(spec["nest"]))
            theta = outers[0].outer_params.detach()
            err = float((theta.double() - reference.theta).abs().max())
            assert err < 1e-4, f"round {round_index}: DiLoCo's θ_outer differs from the reference by {err}"
            for c, outer in zip(clusters, outers, strict=True):
                assert torch.equal(flat(c.model), outer.outer_params.detach()), (
                    "θ_local ← θ_outer did not land"
                )
                if spec["reset"]:
                    c.optimizer.state.clear()
            assert len({r["param_hash"] for r in results}) == 1
            record["rounds"].append(
                {
                    "step": step,
                    "pseudo_grad_norm": results[0]["pseudo_grad_norm"],
                    "outer_lr": lr,
                    "momentum": mom,
                    "drift": float(torch.stack(locals_).std(0).norm()),
                }
            )
        if step % args.eval_interval == 0 or step == args.steps:
            record["val"][step] = evaluate(clusters[0].model, eval_loader, WORLD)
            print(
                f"  {name:<34} step {step:>4} loss {record['loss'][-1]:.4f} val {record['val'][step]:.4f} "
                f"lr {clusters[0].scheduler.get_last_lr()[0]:.2e} ({time.perf_counter() - started:.0f}s)",
                flush=True,
            )
    seen = [set(c.seen) for c in clusters]
    record["disjoint"] = all(
        not (seen[a] & seen[b]) for a in range(len(seen)) for b in range(a + 1, len(seen))
    )
    record["repeats"] = sum(len(c.seen) - len(s) for c, s in zip(clusters, seen, strict=True))
    record["val_ids_overlap"] = bool(set(map(int, clusters[0].plan.val_ids)) & set().union(*seen))
    if galaxy:
        record["jump"] = jump_after_round(record["loss"], local_steps)
    record["seconds"] = time.perf_counter() - started
    return record


def jump_after_round(loss: list[float], local_steps: int) -> float:
    """Mean (loss 2 steps after a round) − (loss of the round's last step), over rounds 2 … : the outer step's
    immediate cost (the loss otherwise falls between neighbouring steps)."""
    jumps = [loss[s + 1] - loss[s - 1] for s in range(2 * local_steps, len(loss) - 2, local_steps)]
    return sum(jumps) / len(jumps) if jumps else float("nan")


DEFAULT_SPEC = {"M": 1, "H": 0, "olr": 0.7, "mom": 0.9, "nest": 1, "owarm": 0, "avg1": 0, "reset": 0}


def parse_arm(text: str, args) -> tuple[str, dict]:
    kind, _, rest = text.partition(":")
    spec = dict(
        DEFAULT_SPEC,
        olr=args.outer_lr,
        mom=args.outer_momentum,
        nest=int(args.nesterov),
        lr=args.lr,
        wd=args.weight_decay,
    )
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in spec:
            raise SystemExit(f"arm {text}: unknown key {key} (known: {', '.join(spec)})")
        spec[key] = type(spec[key])(float(value)) if isinstance(spec[key], float) else int(float(value))
    if kind == "diloco" and spec["H"] < 1:
        raise SystemExit(f"arm {text}: give H")
    if kind not in ("ddp", "half", "diloco"):
        raise SystemExit(f"arm {text}: kind is ddp, half or diloco")
    return text, spec


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="seq 128, batch 16, 200 steps, 5 arms (~10 min)")
    parser.add_argument("--arms", default=None)
    parser.add_argument("--path-model", default=str(REPO / "tests/models/llama-2m-fresh"))
    parser.add_argument("--dataset-path", default=STDLIB)
    parser.add_argument("--data-cache-dir", default=str(REPO / "outputs/data_cache"))
    parser.add_argument("--seq-length", type=int, default=None, help="256 (--quick: 128)")
    parser.add_argument(
        "--batch", type=int, default=None, help="DDP's batch, 32 (--quick: 16); clusters get batch/M"
    )
    parser.add_argument("--steps", type=int, default=None, help="300 (--quick: 200)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--nesterov", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-steps", type=int, default=8)
    parser.add_argument("--eval-batch", type=int, default=16)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON lines, one per arm")
    parser.add_argument(
        "--ddp-val", type=float, default=None, help="DDP's final val_loss when no ddp arm runs"
    )
    args = parser.parse_args()
    for key, full, quick in (("seq_length", 256, 128), ("batch", 32, 16), ("steps", 300, 200)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.arms is None:
        args.arms = (
            "ddp half:M=2 diloco:M=2,H=20 diloco:M=2,H=50"
            if not args.quick
            else "ddp half:M=2 diloco:M=2,H=20 diloco:M=2,H=50 diloco:M=4,H=20"
        )
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    arms = [parse_arm(text, args) for text in args.arms.split()]

    eval_plan = plan_data(
        make_config(args, args.eval_batch, args.lr, args.weight_decay),
        load_model_config(args.path_model).vocab_size,
        1,
        0,
        1,
    )
    eval_loader = build_eval_loader(
        eval_plan, per_device_batch=args.eval_batch, rank=0, world_size=1, steps=args.eval_steps
    )
    if args.eval_steps * args.eval_batch > len(eval_plan.val_ids):
        print(
            f"note: validation reads {args.eval_steps * args.eval_batch} samples of {len(eval_plan.val_ids)}"
        )
    print(
        f"corpus {eval_plan.corpus.num_tokens} tokens; seq {args.seq_length}, DDP batch {args.batch}, "
        f"{args.steps} steps, lr {args.lr}, wd {args.weight_decay}, warm-up {args.warmup_steps}, seed {args.seed}"
    )

    results = []
    for name, spec in arms:
        result = run_arm(args, name, spec, eval_loader)
        results.append(result)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    report(results, args.steps, args.ddp_val)


def report(results: list[dict], steps: int, ddp_val: float | None = None) -> None:
    base = next((r["val"][steps] for r in results if r["arm"] == "ddp"), ddp_val)
    print(
        f"\n{'arm':<40} {'val_loss':>8} {'/DDP':>7} {'target':>7} {'jump':>6} {'|Δ| r1':>7} {'|Δ| last':>8} "
        f"{'paper':>14}  checks"
    )
    for r in results:
        val = r["val"][steps]
        ratio = val / base if base else math.nan
        m = r["spec"]["M"]
        galaxy = r["arm"].startswith("diloco")
        target = f"{TARGET.get(m, math.nan):.2f}" if galaxy and m in TARGET else ""
        norms = [x["pseudo_grad_norm"] for x in r["rounds"]]
        checks = f"disjoint={r['disjoint']} repeats={r['repeats']} val-overlap={r['val_ids_overlap']}"
        print(
            f"{r['arm']:<40} {val:8.4f} {ratio:7.3f} {target:>7} "
            f"{r.get('jump', math.nan):6.3f} {norms[0] if norms else math.nan:7.2f} "
            f"{norms[-1] if norms else math.nan:8.2f} {PAPER.get(m, '') if galaxy else '':>14}  {checks}"
        )


if __name__ == "__main__":
    main()
