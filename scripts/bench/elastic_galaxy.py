"""An elastic galaxy over the WAN lab: clusters without ``--hv.world-rank`` start, join, leave and crash.

Two clusters start the galaxy (its first round needs two), a third and a fourth join later with the same
command, one leaves with Ctrl+C and one is killed with SIGKILL; the run ends with two. Every ledger entry is
checked against the clusters' records: each round bitwise identical among the clusters in it, each joiner in
sync from its first round, each roster as the joins and leaves say; and the data, from the samples the loaders
read (``--sample-log``, audited by ``open-diloco audit-data``'s rules): no page committed twice, none below
the final deal's cursor missing but those the ledger holds in flight, the entries' ``pages`` those the
readings show committed. Prints one line per membership event and a summary (docs/results/membership.md holds
the figures).

    python -m scripts.bench.elastic_galaxy [--profile lan] [--ranks 2] [--out DIR]

Needs root (the lab's network namespaces); fake data.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from open_diloco.data_audit import audit
from open_diloco.local_galaxy import Galaxy, kill_tree, outer_records
from scripts.wan.lab import Lab

FLAGS = ["--fake-data", "--max-steps", "100000", "--hv.local-steps", "10"]
"""What a volunteer types (besides the DHT's address and --hv.galaxy-size 2, which ``start_cluster`` adds): no
rank, default membership and round flags."""


RUNNING: set[str] = set()
"""The clusters that should be running now (a wait stops if one of them ends)."""


def entries(metrics: dict[str, Path]) -> dict[int, dict]:
    """Every ledger entry in the clusters' sync records, by round."""
    return {
        r["ledger"]["round"]: r["ledger"]
        for m in metrics.values()
        for r in outer_records(m).values()
        if r.get("ledger")
    }


def ranks_of(entry: dict) -> set[int]:
    return {member["rank"] for member in entry["members"]}


def wait_for(metrics: dict[str, Path], test, what: str, timeout: float, galaxy: Galaxy) -> tuple[int, float]:
    """The first entry passing ``test``, and when it was seen; stops when a cluster that should run ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = [name for name, proc in galaxy.procs.items() if name in RUNNING and proc.poll() is not None]
        if ended:
            raise SystemExit(
                f"elastic_galaxy: {ended} ended while waiting for an entry {what}: see their logs"
            )
        found = [n for n, e in sorted(entries(metrics).items()) if test(e)]
        if found:
            return found[0], time.monotonic()
        time.sleep(1.0)
    raise SystemExit(f"elastic_galaxy: no entry {what} within {timeout:.0f} s")


def without(rank: int, after: int):
    """An entry after round ``after`` whose roster no longer names ``rank``."""
    return lambda e: e["round"] > after and e.get("roster") is not None and rank not in e["roster"]


def rank_of(metrics: Path, timeout: float = 300.0) -> int:
    """A cluster's galaxy rank, from its metrics' start record (its id's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            return json.loads(metrics.read_text().splitlines()[0])["config"]["hv"]["world_rank"]
        time.sleep(1.0)
    raise SystemExit(f"elastic_galaxy: {metrics} never started")


def run(profile: str, ranks: int, workdir: Path) -> dict:
    events: list[tuple[float, str, int]] = []
    began = time.monotonic()

    def event(what: str, number: int) -> None:
        events.append((round(time.monotonic() - began, 1), what, number))
        print(f"[{events[-1][0]:7.1f}s] {what}: round {number}", flush=True)

    flags = [*FLAGS, "--sample-log", str(workdir / "samples")]
    with Lab(4, profile) as lab:
        galaxy = Galaxy(workdir, lab=lab)
        metrics: dict[str, Path] = {}
        try:
            for name in ("cluster0", "cluster1"):
                metrics[name] = galaxy.start_cluster(None, 2, *flags, nproc=ranks, name=name)
                RUNNING.add(name)
            rank = {name: rank_of(m) for name, m in metrics.items()}
            genesis = wait_for(metrics, lambda e: e["round"] == 1, "1", 600, galaxy)[0]
            event("genesis (cluster0, cluster1)", genesis)
            for name in ("cluster2", "cluster3"):
                metrics[name] = galaxy.start_cluster(None, 2, *flags, nproc=ranks, name=name)
                RUNNING.add(name)
                rank[name] = rank_of(metrics[name])
                joined = wait_for(
                    metrics, lambda e, r=rank[name]: r in ranks_of(e), f"with {name}", 600, galaxy
                )[0]
                event(f"{name} joined", joined)
            RUNNING.discard("cluster1")
            galaxy.procs["cluster1"].send_signal(signal.SIGINT)
            galaxy.wait("cluster1", 120)
            left = wait_for(metrics, without(rank["cluster1"], joined), "without cluster1", 600, galaxy)[0]
            event("cluster1 left (Ctrl+C)", left)
            RUNNING.discard("cluster2")
            kill_tree(galaxy.procs["cluster2"].pid)
            galaxy.track()
            crashed = wait_for(metrics, without(rank["cluster2"], left), "without cluster2", 900, galaxy)[0]
            event("cluster2 dropped (SIGKILL)", crashed)
            end = wait_for(metrics, lambda e: e["round"] >= crashed + 5, "5 rounds on", 600, galaxy)[0]
            RUNNING.clear()
            for name in ("cluster0", "cluster3"):  # both at once: the last one would go on alone
                galaxy.procs[name].send_signal(signal.SIGINT)
            for name in ("cluster0", "cluster3"):
                galaxy.wait(name, 120)
        finally:
            galaxy.close()
    return judge(metrics, rank, events, end, workdir / "samples")


def judge(metrics: dict[str, Path], rank: dict[str, int], events: list, end: int, samples: Path) -> dict:
    """Every entry's round bitwise identical among its members; joiners in sync from their first round; the
    pages the loaders read committed once each (``open_diloco/data_audit.py``)."""
    rounds = {name: outer_records(m) for name, m in metrics.items()}
    pages = audit(samples, list(metrics.values()))
    problems = list(pages.problems)
    for number, entry in sorted(entries(metrics).items()):
        members = [name for name in metrics if rank[name] in ranks_of(entry)]
        hashes = {rounds[name][number]["param_hash"] for name in members if number in rounds[name]}
        if hashes != {entry["after"]}:
            problems.append(f"round {number}: {members} hold {sorted(hashes)}, the entry {entry['after']}")
    for name in ("cluster2", "cluster3"):
        first = min(n for n, e in entries(metrics).items() if rank[name] in ranks_of(e))
        if not rounds[name][first]["in_sync"]:
            problems.append(f"{name}'s first round {first} was not in sync")
    last_together = max(set(rounds["cluster0"]) & set(rounds["cluster3"]))
    final = {rounds[name][last_together]["param_hash"] for name in ("cluster0", "cluster3")}
    if len(final) != 1:
        problems.append(f"round {last_together}: the two that stayed hold {sorted(final)}")
    return {
        "events": events,
        "rounds": len(entries(metrics)),
        "last_checked_round": end,
        "rosters": sorted({tuple(sorted(e.get("roster") or [])) for e in entries(metrics).values()}, key=len),
        "last_round_together": last_together,
        "hashes_then": sorted(final),
        "pages": asdict(pages.dealt) | {"in_flight": len(pages.dealt.in_flight)} if pages.dealt else None,
        "goodput": _goodput(metrics),
        "problems": problems,
    }


def _goodput(metrics: dict[str, Path]) -> float | None:
    """Tokens committed ÷ computed over the clusters, each by its last record that says both."""
    last = [[r for r in outer_records(m).values() if r.get("tokens_computed")][-1:] for m in metrics.values()]
    computed = sum(r[0]["tokens_computed"] for r in last if r)
    return sum(r[0]["tokens_committed"] for r in last if r) / computed if computed else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="lan", help="WAN lab profile (scripts/wan/profiles.toml)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per cluster")
    parser.add_argument("--out", type=Path, default=None, help="where the clusters' logs and metrics go")
    args = parser.parse_args()
    workdir = args.out or Path(tempfile.mkdtemp(prefix="elastic-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = run(args.profile, args.ranks, workdir)
    print(json.dumps(result))
    raise SystemExit(1 if result["problems"] else 0)


if __name__ == "__main__":
    main()
