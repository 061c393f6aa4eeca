"""One arm of the convergence yardstick (``convergence.py``, which says what it measures and how to run it):
M clusters trained one after the other in this process as the trainer sets them up, with the real outer step
every H inner steps through the in-process galaxy, each round checked against a hand-written reference of the
outer math; the clusters' data checked disjoint, their inits identical.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from open_diloco.config import Config, HvConfig
from open_diloco.data import build_train_loader, plan_data
from open_diloco.model import build_model, load_model_config
from open_diloco.optim import build_inner_optimizer, build_scheduler, move_scheduler_to
from open_diloco.outer.digests import fingerprint_bytes
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.state import local_shards
from open_diloco.outer.streaming import SyncSchedule, fragment_length
from open_diloco.outer.testing import InProcessGalaxy
from open_diloco.steps import evaluate, inner_step
from open_diloco.trainer import position_at


def make_config(
    args: argparse.Namespace, batch: int, lr: float, wd: float, steps: int | None = None
) -> Config:
    """The trainer's config of one cluster of an arm of ``steps`` inner (galaxy) steps (default: the
    run's)."""
    steps = steps or args.steps
    return Config(
        path_model=Path(args.path_model),
        seq_length=args.seq_length,
        per_device_train_batch_size=batch,
        total_batch_size=batch,
        lr=lr,
        warmup_steps=args.warmup_steps,
        total_steps=steps,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=wd,
        max_steps=steps,
        seed=args.seed,
        dataset_path=args.dataset_path,
        fake_data=args.dataset_path is None,
        data_cache_dir=Path(args.data_cache_dir),
        num_workers=0,
        eval_samples=args.eval_samples,
        precision="32-true",
        torch_compile=False,
        device=args.device,
    )


WORLD = SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0, is_main=True)
"""One rank per cluster; ``--device`` sets its device."""


class Cluster:
    """One cluster: model, inner optimizer, schedule and its share of the data, as the trainer sets them
    up."""

    def __init__(self, args, spec, rank: int, size: int, batch: int):
        config = make_config(args, batch, spec["lr"], spec["wd"], arm_steps(args, spec))
        vocab = load_model_config(config.path_model).vocab_size
        self.plan = plan_data(config, vocab, 1, rank, size)
        self.model = build_model(config.path_model, config.seed).to(WORLD.device)
        self.model.train()
        self.model.set_requires_gradient_sync = lambda flag: None  # what FSDP2 offers; a no-op unsharded
        self.optimizer = build_inner_optimizer(self.model, config.lr, config.weight_decay, config.adam_betas)
        self.scheduler = build_scheduler(
            self.optimizer, config.warmup_steps, config.schedule_steps, config.min_lr_ratio
        )
        loader = build_train_loader(self.plan, per_device_batch=batch, rank=0, world_size=1, num_workers=0)
        self.batches = self._recording(position_at(0, 0, loader, self.scheduler, 1))
        self.seen: list[tuple[int, int]] = []
        self.max_grad_norm = config.max_grad_norm

    def _recording(self, batches):
        for batch in batches:
            # a sample is (stream, id): fake data gives each cluster its own stream, a corpus shares one
            stream = self.plan.galaxy_rank if self.plan.corpus is None else 0
            self.seen.extend((stream, int(i)) for i in batch["sample_id"])
            yield batch

    def step(self) -> float:
        loss, _ = inner_step(self.model, self.optimizer, self.batches, 1, self.max_grad_norm, WORLD)
        self.scheduler.step()
        return loss

    def pass_step(self, step: int) -> None:
        """Galaxy step ``step``, at which this (slower) cluster takes no inner step: its lr follows the
        galaxy's step."""
        move_scheduler_to(self.scheduler, step)


def arm_steps(args, spec: dict) -> int:
    """The arm's inner (galaxy) steps: ``steps`` if it gives them; with a slower cluster (``slow``: the last
    cluster's speed, ``--hv.round-steps by-speed``) as many more as keep the arm's total tokens those of M
    clusters at full speed; else the run's."""
    if spec.get("steps"):
        return spec["steps"]
    if spec.get("slow"):
        return round(args.steps * spec["M"] / (spec["M"] - 1 + spec["slow"]))
    return args.steps


class ReferenceOuter:
    """The outer step written out by hand, in fp64: g = mean Δ; round k of a warm-up of W rounds uses
    lr_k = 1 + (k−1)/W·(lr − 1), μ_k = (k−1)/W·μ; with μ_k > 0: b ← μ_k·b + g (b = g the first time) and
    θ ← θ − lr_k·(g + μ_k·b) (Nesterov) or θ − lr_k·b; with μ_k = 0: θ ← θ − lr_k·g, b untouched."""

    def __init__(self, theta: torch.Tensor, hv: HvConfig):
        self.theta = theta.clone().double()
        self.buf: torch.Tensor | None = None
        self.hv = hv
        self.rounds = 0

    def hparams(self, k: int) -> tuple[float, float]:
        lr, mom, warm = self.hv.outer_lr, self.hv.outer_momentum, self.hv.outer_warmup_rounds
        if k <= warm:
            return 1 + (k - 1) / warm * (lr - 1), (k - 1) / warm * mom
        return lr, mom

    def step(self, locals_: list[torch.Tensor]) -> None:
        self.rounds += 1
        lr, mom = self.hparams(self.rounds)
        grad = torch.stack([self.theta - t.double() for t in locals_]).mean(0)
        if mom:
            self.buf = grad.clone() if self.buf is None else self.buf.mul(mom).add(grad)
            grad = grad + mom * self.buf if self.hv.outer_nesterov else self.buf
        self.theta -= lr * grad


def flat(model: torch.nn.Module) -> torch.Tensor:
    """The model's values in host memory, where the outer state (θ_outer) lives on every device."""
    return torch.cat([s.reshape(-1) for s in local_shards(model)]).detach().to("cpu", copy=True)


def drift(locals_: list[torch.Tensor]) -> float:
    """How far apart the clusters' models are: ‖std over clusters‖, i.e. sqrt(Σ‖θ_m − mean‖² / (M − 1)).
    Summed a cluster at a time: ``torch.stack(...).std(0)`` reduces across a strided dimension and took 3.2 s
    of a 25M round on a CPU core (more than the rest of the round's outer work together)."""
    if len(locals_) < 2:  # one cluster (an M=1 arm): no spread to measure, as torch.std says
        return float("nan")
    mean_theta = sum(locals_) / len(locals_)
    total = sum(float(torch.sub(theta, mean_theta).square_().sum(dtype=torch.float64)) for theta in locals_)
    return math.sqrt(total / (len(locals_) - 1))


def hv_of(spec: dict, rank: int) -> HvConfig:
    """The arm's galaxy config: HvConfig's defaults (the shipped ones) unless the arm overrides them."""
    overrides = {
        field: spec[key]
        for key, field in (
            ("olr", "outer_lr"),
            ("mom", "outer_momentum"),
            ("nest", "outer_nesterov"),
            ("owarm", "outer_warmup_rounds"),
            ("codec", "compression"),
            ("ef", "error_feedback"),
            ("density", "sparse_density"),
            ("rule", "sparse_rule"),
            ("robust", "robust_mean"),
            ("P", "fragments"),
            ("tau", "sync_delay"),
            ("alpha", "sync_alpha"),
        )
        if spec.get(key) is not None
    }
    if spec.get("slow"):  # the last cluster at that share of the others' speed, fixed
        overrides["round_steps"] = "by-speed"
        overrides["cluster_speed"] = spec["slow"] if rank == spec["M"] - 1 else 1.0
    return HvConfig(
        galaxy_size=spec["M"],
        world_rank=rank,
        local_steps=spec["H"],
        on_partial_round="proceed",
        **overrides,
    )


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
        outers, reference, streaming = start_galaxy(spec, clusters, record)
    started = time.perf_counter()
    steps = arm_steps(args, spec)
    record["steps"] = steps
    for step in range(1, steps + 1):
        trains = [not galaxy or outer.trains_at(step) for outer in (outers if galaxy else [None])]
        losses = [c.step() for c, trained in zip(clusters, trains, strict=True) if trained]
        for c, trained in zip(clusters, trains, strict=True):
            if not trained:
                c.pass_step(step)
        record["loss"].append(sum(losses) / len(losses))
        if galaxy and streaming:
            streaming_step(outers, step, step == steps, record, trains)
        elif galaxy and step % local_steps == 0:
            checked_round(clusters, outers, reference, spec, step, record)
        if step % args.eval_interval == 0 or step == steps:
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
    val_ids = clusters[0].plan.val_ids  # fake data validates on a stream of its own
    record["val_ids_overlap"] = val_ids is not None and bool(
        {(0, int(i)) for i in val_ids} & set().union(*seen)
    )
    if galaxy:
        record["jump"] = jump_after_round(record["loss"], local_steps)
    record["seconds"] = time.perf_counter() - started
    return record


def start_galaxy(
    spec: dict, clusters: list[Cluster], record: dict
) -> tuple[list[DiLoCo], ReferenceOuter, bool]:
    """The arm's galaxy, after checking its clusters start from the same weights: one DiLoCo per cluster
    over the in-process galaxy, the reference outer step, and whether the arm streams (``P``/``tau``)."""
    size, local_steps = spec["M"], spec["H"]
    hashes = {fingerprint_bytes(flat(c.model)) for c in clusters}
    assert len(hashes) == 1, "clusters start from different weights"
    hvs = [hv_of(spec, m) for m in range(size)]
    averagers = InProcessGalaxy(
        size,
        compression=hvs_compression(spec),
        robust_mean=bool(spec.get("robust")),
        sparse_rule=hvs[0].sparse_rule,
    )
    record["outer"] = {
        "outer_lr": hvs[0].outer_lr,
        "outer_momentum": hvs[0].outer_momentum,
        "outer_nesterov": hvs[0].outer_nesterov,
        "outer_warmup_rounds": hvs[0].outer_warmup_rounds,
    }
    # an arm with a slower cluster runs its outer loops after every step too: they count the steps taken
    streaming = SyncSchedule(local_steps, hvs[0].fragments, hvs[0].sync_delay).streaming or bool(
        spec.get("slow")
    )
    outers = [
        DiLoCo(
            c.model,
            averagers.averager(m, fragment_length(flat(c.model).numel(), hvs[m].fragments)),
            hvs[m],
            warn=print,
        )
        for m, c in enumerate(clusters)
    ]
    return outers, ReferenceOuter(outers[0].state.params, hvs[0]), streaming


def checked_round(
    clusters: list[Cluster],
    outers: list[DiLoCo],
    reference: ReferenceOuter,
    spec: dict,
    step: int,
    record: dict,
) -> None:
    """A whole-model round after inner step ``step``, checked: θ_outer against the reference (uncompressed,
    plain mean), θ_local ← θ_outer in every model, the same θ_outer in every cluster; its figures go to
    ``record``."""
    round_index = step // spec["H"]
    locals_ = [flat(c.model) for c in clusters]
    results = outer_steps_in_threads(outers, step)
    reference.step(locals_)
    theta = outers[0].state.params
    err = float((theta.double() - reference.theta).abs().max())
    if spec.get("codec") in (None, "none") and not spec.get("robust"):  # their rounding/clipping is the point
        assert err < 1e-4, f"round {round_index}: DiLoCo's θ_outer differs from the reference by {err}"
    for c, outer in zip(clusters, outers, strict=True):
        # a sparse round leaves what it did not send in the model
        assert outer.state.keeps_unsent or torch.equal(flat(c.model), outer.state.params), (
            "θ_local ← θ_outer did not land"
        )
        if spec["reset"]:
            c.optimizer.state.clear()
    assert len({r["param_hash"] for r in results}) == 1, "clusters' θ_outer differ"
    lr, mom = outers[0].state.hparams(round_index)
    record["rounds"].append(
        {
            "step": step,
            "pseudo_grad_norm": results[0]["pseudo_grad_norm"],
            "outer_lr": lr,
            "momentum": mom,
            "drift": drift(locals_),
            "bytes_sent": results[0]["bytes_sent"],
            "fp32_bytes": 4 * theta.numel(),
        }
    )


def outer_steps_in_threads(
    outers: list[DiLoCo], step: int, last: bool = False, trained: list[bool] | None = None
) -> list[dict]:
    """Every cluster's outer loop after inner step ``step`` (``trained``: which clusters took one), in
    threads, so that a round's clusters meet."""
    results: list = [None] * len(outers)
    trained = trained or [True] * len(outers)

    def outer_step(m: int) -> None:
        results[m] = outers[m].after_inner_step(step, last, trained[m])

    threads = [threading.Thread(target=outer_step, args=(m,)) for m in range(len(outers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def streaming_step(
    outers: list[DiLoCo], step: int, last: bool, record: dict, trained: list[bool] | None = None
) -> None:
    """The outer loops of a streaming arm after inner step ``step``; a landed sync must leave every cluster
    with the same θ_outer."""
    results = outer_steps_in_threads(outers, step, last, trained)
    if results[0]:
        assert len({r["param_hash"] for r in results}) == 1, "clusters' θ_outer differ"
        record["rounds"].append(
            {
                "step": step,
                "fragment": results[0]["fragment"],
                "pseudo_grad_norm": results[0]["pseudo_grad_norm"],
                "bytes_sent": results[0]["bytes_sent"],
                "fp32_bytes": 4 * outers[0].state.numel,
            }
        )


def hvs_compression(spec: dict) -> str:
    return spec.get("codec") or "none"


def jump_after_round(loss: list[float], local_steps: int) -> float:
    """Mean (loss 2 steps after a round) − (loss of the round's last step), over rounds 2 … : the outer step's
    immediate cost (the loss otherwise falls between neighbouring steps)."""
    jumps = [loss[s + 1] - loss[s - 1] for s in range(2 * local_steps, len(loss) - 2, local_steps)]
    return sum(jumps) / len(jumps) if jumps else float("nan")
