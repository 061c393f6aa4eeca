r"""Unequal clusters (issue 37): a galaxy of two 1-rank clusters, one on a core of its own, the other on the
other core capped at ``--slow-share`` of it by a CPU cgroup (its whole process tree: trainer, DHT, averager,
p2pd), over the WAN lab's ``--profile`` (or 127.0.0.1 with ``--profile none``). Runs, in one go:

1. ``solo``: each cluster alone, same placement, no galaxy: its inner-step speed (the baseline);
2. ``equal``: the galaxy with ``--hv.round-steps equal`` (every cluster takes H steps a round);
3. ``by-speed``: the galaxy with ``--hv.round-steps by-speed`` (speeds measured, not given).

    python scripts/bench/unequal_clusters.py                       # intercontinental, H = 40, τ = H
    python scripts/bench/unequal_clusters.py --profile none --rounds 4

Printed per galaxy mode and cluster, over the steady rounds (from the first round's landing to the step
before the last, whose wait for the final round nothing can hide):

- ``busy``: Σ inner-step seconds ÷ wall seconds, the share of time the cluster computes;
- ``steps/round``: the inner steps it took per round (H for every cluster with equal steps);
- ``tok/s``: tokens it trained on per wall second; the galaxy's is the sum, and ``÷ solo`` divides it by the
  sum of the two clusters' solo speeds (tokens per step ÷ median step seconds of the solo run).

Needs root (cgroups, the lab's namespaces) and a cgroup-v1 ``cpu`` controller at /sys/fs/cgroup/cpu (cgroup
v2's ``cpu.max`` is used where that is what the machine has). Every process is ended by PID
(``open_diloco/local_galaxy.py``); the cgroup is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from open_diloco.local_galaxy import Galaxy, read_metrics

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: the lab (scripts/wan) is imported as scripts.wan

from scripts.wan.lab import Lab  # noqa: E402

MODEL = REPO / "tests/models/llama-2m-fresh"
SEQ, BATCH = 64, 4


@contextmanager
def cpu_cgroup(share: float):
    """A CPU cgroup holding ``share`` of one core; yields its directory (write a PID to its ``cgroup.procs``
    to move a process and its future children in)."""
    v1 = Path("/sys/fs/cgroup/cpu")
    root = v1 if (v1 / "cpu.cfs_quota_us").exists() else Path("/sys/fs/cgroup")
    group = root / f"open_diloco-slow-{os.getpid()}"
    group.mkdir()
    try:
        if root == v1:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(int(share * 100000)))
        else:
            (group / "cpu.max").write_text(f"{int(share * 100000)} 100000")
        yield group
    finally:
        for _ in range(50):  # its processes are gone by now (the galaxy ended them); rmdir once they are
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


class Placement:
    """The lab (or 127.0.0.1), with each cluster pinned to a core of its own and cluster 1 in the cgroup."""

    def __init__(self, lab: Lab | None, cgroup: Path):
        self.lab, self.cgroup = lab, cgroup

    def address(self, endpoint: str) -> str:
        return self.lab.address(endpoint) if self.lab else "127.0.0.1"

    def exec_prefix(self, endpoint: str) -> list[str]:
        prefix = self.lab.exec_prefix(endpoint) if self.lab else []
        if endpoint == "cluster0":
            return [*prefix, "taskset", "-c", "0"]
        if endpoint == "cluster1":  # into the cgroup first: `ip netns exec` mounts a /sys of its own
            enter = f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"'
            return ["sh", "-c", enter, "sh", *prefix, "taskset", "-c", "1"]
        return prefix


def run_galaxy(placement: Placement, workdir: Path, flags: list[str], timeout: float) -> list:
    """Both clusters with ``flags``; their records."""
    workdir.mkdir(parents=True, exist_ok=True)
    galaxy = Galaxy(workdir, lab=placement if placement.lab else None)
    if not placement.lab:
        galaxy._place = placement.exec_prefix  # the placement without a lab: taskset and the cgroup only
    try:
        metrics = [galaxy.start_cluster(rank, 2, *flags, nproc=1) for rank in (0, 1)]
        for rank in (0, 1):
            code = galaxy.wait(f"cluster{rank}", timeout)
            assert code == 0, galaxy.log(f"cluster{rank}")[-3000:]
    finally:
        galaxy.close()
    return [read_metrics(path) for path in metrics]


def steady(records: list[dict]) -> dict:
    """Busy share, steps per round and tokens/s over the steady part: after the first sync, to the end."""
    syncs = [r for r in records if "outer_step" in r]
    # from the first landing (the first round ran before any speed was known) to the step before the last:
    # the last step waits for the run's final round, which nothing follows to hide it behind
    start = syncs[0]["time"]
    end = max(r["time"] for r in records if r["step"] < records[-1]["step"])
    window = [r for r in records if start < r["time"] <= end and r.get("trained", True)]
    wall = end - start
    busy = sum(r["step_seconds"] for r in window)
    per_round = [r.get("round_inner_steps") for r in syncs[1:]]
    return {
        "busy": busy / wall,
        "steps_per_round": statistics.median(s for s in per_round if s is not None)
        if any(per_round)
        else None,
        "tokens_per_second": len(window) * BATCH * SEQ / wall,
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", default="intercontinental", help="a WAN lab profile, or `none`")
    parser.add_argument("--slow-share", type=float, default=0.5, help="cluster 1's share of its core")
    parser.add_argument("--local-steps", type=int, default=40, help="H (of the fastest cluster)")
    parser.add_argument("--sync-delay", type=int, default=None, help="τ (default H: the round is hidden)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per galaxy run (the first warms up)")
    parser.add_argument("--modes", nargs="+", default=["equal", "by-speed"], choices=["equal", "by-speed"])
    parser.add_argument("--matchmaking-time", type=float, default=4.0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="unequal-"))
    delay = args.local_steps if args.sync_delay is None else args.sync_delay
    common = [
        "--path-model",
        str(MODEL),
        "--seq-length",
        str(SEQ),
        "--per-device-train-batch-size",
        str(BATCH),
        "--max-steps",
        str(args.local_steps * args.rounds),
        "--warmup-steps",
        "5",
    ]
    galaxy_flags = [
        "--hv.local-steps",
        str(args.local_steps),
        "--hv.sync-delay",
        str(delay),
        "--hv.matchmaking-time",
        str(args.matchmaking_time),
        "--hv.averaging-timeout",
        "300",
        "--hv.join-timeout",
        "120",
    ]
    print(
        f"# {time.strftime('%Y-%m-%d')}: 2 one-rank clusters of {MODEL.name}, cluster 1 at "
        f"{args.slow_share} of a core; profile {args.profile}; H = {args.local_steps}, τ = {delay}; "
        f"{args.rounds} rounds",
        flush=True,
    )
    with ExitStack() as stack:
        cgroup = stack.enter_context(cpu_cgroup(args.slow_share))
        lab = stack.enter_context(Lab(2, args.profile)) if args.profile != "none" else None
        placement = Placement(lab, cgroup)
        # solo: the two clusters at once, each on its own (a sync never comes: H beyond the run's steps)
        never = ["--hv.local-steps", str(10 * args.local_steps * args.rounds)]
        solo = run_galaxy(placement, workdir / "solo", [*common, *never], timeout=1800)
        solo_speed = [BATCH * SEQ / statistics.median(r["step_seconds"] for r in side[5:]) for side in solo]
        print(f"solo tok/s: cluster0 {solo_speed[0]:.0f}, cluster1 {solo_speed[1]:.0f}", flush=True)
        print(f"{'mode':<9} {'cluster':>7} {'busy':>6} {'steps/round':>11} {'tok/s':>7}  galaxy tok/s ÷ solo")
        for mode in args.modes:
            flags = [*common, *galaxy_flags, "--hv.round-steps", mode]
            records = run_galaxy(placement, workdir / mode, flags, timeout=3600)
            figures = [steady(side) for side in records]
            total = sum(f["tokens_per_second"] for f in figures)
            for rank, fig in enumerate(figures):
                ratio = f"{total:.0f} ÷ {sum(solo_speed):.0f} = {total / sum(solo_speed):.3f}" if rank else ""
                print(
                    f"{mode:<9} {rank:>7} {fig['busy']:>6.1%} {fig['steps_per_round'] or '-':>11} "
                    f"{fig['tokens_per_second']:>7.0f}  {ratio}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
