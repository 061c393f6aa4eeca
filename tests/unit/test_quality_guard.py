"""The quality guard (issue 53): the yardstick of docs/results/training-quality.md at a size the suite can
afford, so that a change to the outer step, the round's arithmetic, the model build, the data order or the
schedules that costs the galaxy quality fails here rather than in a week's measurements.

It runs ``scripts/bench/convergence.py`` itself (the in-process galaxy with the real ``DiLoCo`` outer loop,
the trainer's init, data split, AdamW and schedule) on the 1M model over the fake-data stream (no corpus on
disk to drift), DDP against DiLoCo M=2, H=5, over fixed seeds, and compares the mean per-seed ratio with the
distribution measured over more seeds. A float difference (another CPU, another torch build) acts like another
seed, so the band is the noise of a 4-seed mean, not zero.

The guard's own power is checked in the same test: an arm whose outer step moves θ_outer by half the averaged
pseudo-gradient (``olr=0.5``: θ ← θ − ½·mean Δ, what a halved Δ does) must fall outside the band, far (on one
seed: it ends ~0.26 above the shipped ratio, where seeds spread by ~0.011).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from statistics import mean

from scripts.bench.convergence_report import final_val
from tests.conftest import REPO

SEEDS = (0, 1, 2, 3)
HEALTHY, BROKEN = "diloco:M=2,H=5", "diloco:M=2,H=5,olr=0.5"
SETTING = [
    "--dataset-path",
    "fake",
    "--path-model",
    str(REPO / "tests/models/llama-1m-fresh"),
    "--seq-length",
    "64",
    "--batch",
    "8",
    "--steps",
    "60",
    "--warmup-steps",
    "5",
    "--eval-interval",
    "60",
    "--eval-samples",
    "64",
]
# DiLoCo ÷ DDP (final val_loss, per seed) of this setting over seeds 0-7, 2026-12-01, 2-core CPU, torch
# 2.13.0 (docs/results/training-quality.md, "The guard"): 1.065 1.088 1.066 1.082 1.061 1.068 1.072 1.089
REFERENCE_MEAN = 1.0739
SEED_SD = 0.0111
BAND = 4 * SEED_SD / math.sqrt(len(SEEDS))
"""How far the mean over SEEDS may move from REFERENCE_MEAN: 4 standard errors of a mean of len(SEEDS)
seeds (a fresh draw of seeds, or another machine's floats, stays inside it but for 1 time in ~16,000)."""


def run_setting(tmp_path, arms: list[str], seeds: tuple[int, ...]) -> list[dict]:
    """The yardstick's records of ``arms`` over ``seeds``, run in one process (``--jobs 1``: the suite's
    workers already keep the cores busy, and one import of torch serves every seed)."""
    out = tmp_path / f"arms-{len(arms)}-{len(seeds)}.jsonl"
    command = [
        sys.executable,
        str(REPO / "scripts/bench/convergence.py"),
        *SETTING,
        "--arms",
        " ".join(arms),
        "--seeds",
        ",".join(map(str, seeds)),
        "--jobs",
        "1",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["disjoint"] and not r["repeats"] for r in records), "the clusters' data overlapped"
    return records


def ratios(records: list[dict], ddp: dict[int, float], arm: str) -> list[float]:
    """``arm``'s final val_loss divided by DDP's of the same seed, per seed."""
    return [
        final_val(r) / ddp[r["seed"]] for r in sorted(records, key=lambda r: r["seed"]) if r["arm"] == arm
    ]


def test_diloco_stays_as_far_from_ddp_as_measured_and_a_halved_outer_step_fails(tmp_path):
    records = run_setting(tmp_path, ["ddp", HEALTHY], SEEDS)
    ddp = {r["seed"]: final_val(r) for r in records if r["arm"] == "ddp"}
    per_seed = ratios(records, ddp, HEALTHY)
    healthy = mean(per_seed)
    assert abs(healthy - REFERENCE_MEAN) <= BAND, (
        f"DiLoCo ends {healthy:.4f} of DDP over seeds {SEEDS} (per seed {per_seed}), measured "
        f"{REFERENCE_MEAN:.4f} ± {BAND:.4f}: the galaxy's quality moved; run the yardstick "
        "(docs/results/training-quality.md) before changing the reference"
    )
    # one seed is enough for the broken arm: it ends ~0.26 above the shipped ratio, ~20 seeds' spread
    broken = ratios(run_setting(tmp_path, [BROKEN], SEEDS[:1]), ddp, BROKEN)[0]
    assert broken - REFERENCE_MEAN > 2 * BAND, (
        f"the guard cannot tell a halved outer step ({broken:.4f}) from the shipped one ({healthy:.4f})"
    )
