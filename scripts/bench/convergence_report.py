"""The yardstick's table (``convergence.py`` runs the arms, ``convergence_arms.py`` one arm): each arm's final
val_loss per seed, its ratio to DDP taken per seed and averaged, and whether a galaxy arm met its target.
Reads finished arm records only (JSON lines of ``--out``), so a test can judge them without the bench's
imports."""

from __future__ import annotations

import math
from statistics import mean, stdev

PAPER = {  # arXiv 2503.09799, H=30, tuned outer lr, Nesterov 0.9 (final loss vs DDP), as quoted in issue 12
    1: "M=1 beats DDP",
    2: "+0.7% (35M)",
    4: "(not quoted)",
}
TARGET = {2: 1.02, 4: 1.04}


def final_val(record: dict) -> float:
    """The arm's val_loss after its last step (JSON turns the step keys into strings)."""
    return record["val"][max(record["val"], key=int)]


def report(
    results: list[dict],
    steps: int,
    ddp_val: float | None = None,
    half_val: float | None = None,
    targets: dict[int, float] = TARGET,
) -> list[str]:
    """One row per arm: its val_loss per seed, and its ratio to DDP's taken per seed (the same init and data
    order), averaged over seeds, ± its standard error. Returns the galaxy arms that missed their target
    (ratio to DDP above ``targets``, by M, or not below the cluster alone with 1/M of the tokens)."""
    missed = []
    ddp = {r["seed"]: final_val(r) for r in results if r["arm"] == "ddp"}
    arms: dict[str, list[dict]] = {}
    for r in results:
        arms.setdefault(r["arm"], []).append(r)
    for runs in arms.values():
        runs.sort(key=lambda r: r["seed"])
    halves = {
        runs[0]["spec"]["M"]: mean(final_val(r) for r in runs)
        for name, runs in arms.items()
        if name.startswith("half")
    }
    print(
        f"\n{'arm':<40} {'val_loss':>8} {'/DDP':>7} {'±se':>6} {'target':>7} {'ok':>3} {'jump':>6} "
        f"{'|Δ| r1':>7} {'|Δ| last':>8} {'fp32/wire':>9} {'paper':>14}  per seed; checks"
    )
    for name, runs in arms.items():
        val = mean(final_val(r) for r in runs)
        ratios = [final_val(r) / base for r in runs if (base := ddp.get(r["seed"], ddp_val))]
        ratio = mean(ratios) if ratios else math.nan
        spread = stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else math.nan
        m = runs[0]["spec"]["M"]
        galaxy = name.startswith("diloco")
        target, ok = "", ""
        if galaxy and m in targets:
            target = f"{targets[m]:.2f}"
            half = halves.get(m, half_val if m == 2 else None)
            ok = "yes" if ratio <= targets[m] and (half is None or val < half) else "no"
            if ok == "no":
                missed.append(name)
        rounds = [x for r in runs for x in r["rounds"]]
        norms = [r["rounds"] for r in runs if r["rounds"]]
        first = mean(x[0]["pseudo_grad_norm"] for x in norms) if norms else math.nan
        last = mean(x[-1]["pseudo_grad_norm"] for x in norms) if norms else math.nan
        ratio_bytes = (
            sum(x["fp32_bytes"] for x in rounds) / sum(x["bytes_sent"] for x in rounds)
            if rounds
            else math.nan
        )
        jump = mean(r.get("jump", math.nan) for r in runs)
        per_seed = " ".join(f"s{r['seed']}={final_val(r):.4f}" for r in runs)
        checks = all(r["disjoint"] and not r["repeats"] and not r["val_ids_overlap"] for r in runs)
        print(
            f"{name:<40} {val:8.4f} {ratio:7.3f} {spread:6.3f} {target:>7} {ok:>3} {jump:6.3f} {first:7.2f} "
            f"{last:8.2f} {ratio_bytes:9.1f} {PAPER.get(m, '') if galaxy else '':>14}  {per_seed}; "
            f"{'disjoint, no repeats, val unseen' if checks else 'DATA CHECK FAILED'}"
        )
    return missed
