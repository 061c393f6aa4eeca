"""Overlap yardstick: does the network idle the clusters? A real galaxy over the WAN lab (scripts/wan/), once
with blocking outer steps (``--hv.fragments 1 --hv.sync-delay 0``) and once streaming (``--hv.fragments P``
with the largest delay, H/P: a sync lands at the step the next starts), in the same run, same lab, same H
(issue 17).

    python scripts/bench/overlap.py                                       # intercontinental, 25M, H 32, P 4
    python scripts/bench/overlap.py --model 100m --local-steps 24 --fragments 4
    # a whole round in flight, τ = H:
    python scripts/bench/overlap.py --model 100m --local-steps 18 --fragments 1

Needs root and iproute2 (the lab's). Each arm starts ``hivemind-dht`` and two 1-rank clusters in the lab's
namespaces (open_diloco/local_galaxy.py, which ends everything by PID) and trains ``--cycles`` + 2 cycles of H
inner steps; the first and last cycle (start-up, the run's final landing) are left out. Printed per arm:

- ``busy``: Σ inner-step seconds ÷ wall seconds over the measured cycles (wall from when each metrics line
  appeared, polled every 50 ms): the share of time the cluster computed;
- ``util``: the mean of the ``compute_utilization`` metric of the syncs in the window (the share of wall time
  the trainer was not held by the outer loop);
- ``wait s``: Σ ``network_wait_seconds`` in the window (what the inner loop waited for the network);
- ``steps/s``, and ``× blocking``: that throughput ÷ the blocking arm's (the speed-up; on this CPU machine the
  background all-reduce shares the two cores with the inner steps, so it is below busy ÷ busy);
- ``peak MB``: the largest bytes sent + received by one sync, and ``allreduce s``: the median sync's
  all-reduce.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from open_diloco.local_galaxy import Galaxy, with_overrides

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: the lab (scripts/wan) and its bench are imported as scripts.*

from scripts.bench.wan import MODELS  # noqa: E402
from scripts.bench.wan_rounds import watch  # noqa: E402
from scripts.wan.lab import Lab  # noqa: E402


def run_arm(
    profile: str,
    model: str,
    local_steps: int,
    fragments: int,
    delay: int,
    cycles: int,
    matchmaking: float,
    workdir: Path,
    extra: list[str],
) -> dict:
    steps = local_steps * (cycles + 2)
    flags = [
        "--path-model",
        str(MODELS[model]),
        "--max-steps",
        str(steps),
        "--hv.local-steps",
        str(local_steps),
        "--hv.fragments",
        str(fragments),
        "--hv.sync-delay",
        str(delay),
        "--hv.averaging-timeout",
        "900",
        "--hv.join-timeout",
        "120",
        "--hv.matchmaking-time",
        str(matchmaking),
        "--seq-length",
        "64",
    ]
    flags = with_overrides(flags, extra)
    with Lab(2, profile) as lab:
        galaxy = Galaxy(workdir, lab=lab)
        try:
            names = ["cluster0", "cluster1"]
            metrics = [galaxy.start_cluster(rank, 2, *flags, nproc=1) for rank in (0, 1)]
            seen = watch(galaxy, metrics, names, timeout=3600)
        finally:
            galaxy.close()
    records = seen[0]
    first, last = local_steps, local_steps * (cycles + 1)
    window = [records[s] for s in range(first + 1, last + 1)]
    syncs = [r for r in window if "outer_step" in r]
    assert syncs and all(r["galaxy_peers"] == 2 for r in syncs), "a sync in the window was partial"
    for k in {r["outer_step"] for r in syncs}:
        hashes = {r["param_hash"] for s in seen for r in s.values() if r.get("outer_step") == k}
        assert len(hashes) == 1, f"sync {k}: the clusters' θ_outer differ"
    wall = records[last]["seen"] - records[first]["seen"]
    return {
        "profile": profile,
        "model": model,
        "H": local_steps,
        "P": fragments,
        "tau": delay,
        "busy": sum(r["step_seconds"] for r in window) / wall,
        "util": statistics.mean(r["compute_utilization"] for r in syncs),
        "wait_s": sum(r["network_wait_seconds"] for r in syncs),
        "steps_per_s": len(window) / wall,
        "peak_mb": max(r["bytes_sent"] + r["bytes_received"] for r in syncs) / 1e6,
        "allreduce_s": statistics.median(r["allreduce_seconds"] for r in syncs),
        "syncs": len(syncs),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", default="intercontinental")
    parser.add_argument("--model", default="25m", choices=sorted(MODELS))
    parser.add_argument("--local-steps", type=int, default=32)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument(
        "--cycles", type=int, default=2, help="cycles of H steps measured (one more before, one after)"
    )
    parser.add_argument(
        "--delay", type=int, help="the streaming arm's --hv.sync-delay (default: the largest, H/P)"
    )
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    parser.add_argument(
        "--extra",
        default="",
        help="more trainer flags for both arms, e.g. "
        "'--hv.compression int8 --precision bf16-mixed' (later flags win)",
    )
    args = parser.parse_args()
    stride = args.local_steps // args.fragments
    arms = [("blocking", 1, 0), ("streaming", args.fragments, stride if args.delay is None else args.delay)]
    rows = []
    print(
        f"{'arm':<10} {'profile':<17} {'model':>5} {'H':>3} {'P':>2} {'τ':>3} {'busy':>6} {'util':>6} "
        f"{'wait s':>7} {'steps/s':>8} {'× blocking':>10} {'peak MB':>8} {'allreduce s':>11}",
        flush=True,
    )
    for name, fragments, delay in arms:
        with tempfile.TemporaryDirectory(prefix="overlapbench-") as workdir:
            row = run_arm(
                args.profile,
                args.model,
                args.local_steps,
                fragments,
                delay,
                args.cycles,
                args.matchmaking_time,
                Path(workdir),
                shlex.split(args.extra),
            )
        row["arm"] = name
        row["speedup"] = row["steps_per_s"] / rows[0]["steps_per_s"] if rows else 1.0
        rows.append(row)
        print(
            f"{name:<10} {args.profile:<17} {args.model:>5} {args.local_steps:>3} {fragments:>2} {delay:>3} "
            f"{row['busy']:>6.0%} {row['util']:>6.0%} {row['wait_s']:>7.1f} {row['steps_per_s']:>8.3f} "
            f"{row['speedup']:>10.2f} {row['peak_mb']:>8.1f} {row['allreduce_s']:>11.2f}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
