"""Does a galaxy's memory grow with its rounds? A month-long run takes thousands of syncs, so a process that
keeps a few KiB per round (DHT records that never expire, a list of past rounds, an asyncio task per round)
would end it, and no short test would see it.

    python scripts/bench/memory_soak.py --rounds 600                  # ~20 min on 2 CPUs
    python scripts/bench/memory_soak.py --rounds 600 --local-steps 2 --out /tmp/soak.json

Two 1-rank clusters of the suite's 1M model (``local_galaxy.SHALLOW_MODEL``) train on fake data and average
every ``--local-steps`` inner steps on 127.0.0.1 with a ``hivemind-dht``: as many rounds per minute as the
matchmaking allows, each with its status heartbeats, membership records and proofs. Every ``--interval``
seconds each process's private memory (USS: Private_Clean + Private_Dirty of ``/proc/<pid>/smaps_rollup``) is
read by role (the rank's ``trainer``, hivemind's ``dht`` and ``averager`` processes, ``p2pd``, the bootstrap
``hivemind-dht``) beside the cluster's outer step. After a warm-up (the first ``--warmup`` of the rounds:
allocators, caches and routing tables filling), a least-squares line of USS against the outer step gives each
role's growth per round, printed as KiB per round and MiB per 10,000 rounds (a month of 4-minute rounds is
~11,000). A slope within the noise of the samples (a few hundred KiB over the run, the allocator's own
fluctuation) is no leak; a steady one is. Every process is ended by PID before it exits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from open_diloco.local_galaxy import Galaxy, read_metrics  # noqa: E402
from scripts.bench.outer_memory_trainer import by_role, tree_sizes  # noqa: E402

MIB = 2**20
ROLES = {"trainer", "dht", "averager", "p2pd"}


def outer_step(metrics: Path) -> int:
    """The cluster's latest outer step (0 before its first round)."""
    if not metrics.exists():
        return 0
    return max((r["outer_step"] for r in read_metrics(metrics) if "outer_step" in r), default=0)


class Sampler:
    """Every ``interval`` seconds: each cluster's outer step and USS by role, and the bootstrap DHT's USS."""

    def __init__(self, galaxy: Galaxy, metrics: list[Path], interval: float):
        self.galaxy, self.metrics, self.interval = galaxy, metrics, interval
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.wait(self.interval):
            sample: dict = {"seconds": time.monotonic() - start}
            for rank, metrics in enumerate(self.metrics):
                sizes = tree_sizes(self.galaxy.procs[f"cluster{rank}"].pid)
                sample[f"cluster{rank}"] = {"outer_step": outer_step(metrics), **by_role(sizes, "uss")}
            sample["bootstrap"] = sum(s["uss"] for s in tree_sizes(self.galaxy.procs["dht"].pid).values())
            self.samples.append(sample)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than 2 distinct x, where there is no line)."""
    if len({x for x, _ in points}) < 2:
        return 0.0
    return statistics.linear_regression(*zip(*points, strict=True)).slope


def growth(samples: list[dict], warmup_rounds: int) -> list[dict]:
    """Per cluster and role: USS after the warm-up and at the end, and the fitted growth per round. The
    bootstrap DHT is fitted against cluster 0's outer step."""
    rows = []
    for name in ("cluster0", "cluster1", "bootstrap"):
        step_of = "cluster0" if name == "bootstrap" else name
        # while both clusters train: every role of theirs up (not starting, not shutting down)
        clusters = ("cluster0", "cluster1")
        warm = [
            s
            for s in samples
            if s[step_of]["outer_step"] > warmup_rounds and all(ROLES <= s[c].keys() for c in clusters)
        ]
        if not warm:
            raise SystemExit(
                "no sample of a training galaxy after the warm-up: more --rounds, or a shorter --interval"
            )
        roles = ["hivemind-dht"] if name == "bootstrap" else sorted(ROLES)
        for role in roles:

            def uss(sample: dict, name: str = name, role: str = role) -> int:
                return sample[name] if name == "bootstrap" else sample[name].get(role, 0)

            points = [(s[step_of]["outer_step"], uss(s)) for s in warm]
            rows.append(
                {
                    "process": f"{name} {role}" if name != "bootstrap" else role,
                    "rounds": f"{points[0][0]}..{points[-1][0]}",
                    "uss_warm_mib": points[0][1] / MIB,
                    "uss_end_mib": points[-1][1] / MIB,
                    "kib_per_round": slope(points) / 1024,
                }
            )
    return rows


def run(rounds: int, local_steps: int, interval: float, workdir: Path) -> list[dict]:
    """Two clusters through ``rounds`` rounds; the samples."""
    galaxy = Galaxy(workdir)
    sampler = None
    try:
        flags = ["--max-steps", str(rounds * local_steps), "--hv.local-steps", str(local_steps)]
        metrics = [galaxy.start_cluster(rank, 2, *flags, nproc=1) for rank in (0, 1)]
        sampler = Sampler(galaxy, metrics, interval)
        for rank in (0, 1):
            code = galaxy.wait(f"cluster{rank}", timeout=rounds * 30 + 300)
            assert code == 0, galaxy.log(f"cluster{rank}")[-3000:]
    finally:
        samples = sampler.stop() if sampler else []
        galaxy.close()
    return samples


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| process | rounds fitted | USS after warm-up | USS at end | KiB per round "
        "| MiB per 10,000 rounds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['process']} | {r['rounds']} | {r['uss_warm_mib']:.1f} MiB | {r['uss_end_mib']:.1f} MiB "
            f"| {r['kib_per_round']:.2f} | {r['kib_per_round'] * 10_000 / 1024:.0f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=600)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the rounds left out of the fit")
    parser.add_argument("--out", type=Path, help="also write the samples and rows as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memory-soak-") as tmp:
        started = time.monotonic()
        samples = run(args.rounds, args.local_steps, args.interval, Path(tmp))
        seconds = time.monotonic() - started
    rows = growth(samples, int(args.rounds * args.warmup))
    shape = f"{args.rounds} rounds of H = {args.local_steps}, 2 clusters x 1 rank"
    print(f"{shape}, {seconds:.0f} s, {len(samples)} samples")
    print("\n".join(table(rows)))
    if args.out:
        args.out.write_text(json.dumps({"samples": samples, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
