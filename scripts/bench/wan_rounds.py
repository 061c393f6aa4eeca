"""Which rounds of a WAN bench run count, and what they measured (scripts/bench/wan.py, overlap.py): each
cluster's records as they appear, the steady rounds among them, and per round the split of its seconds and
what the links carried against the bytes it logged."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from open_diloco.local_galaxy import Galaxy, read_metrics

if TYPE_CHECKING:
    from scripts.wan.lab import Lab


def watch(
    galaxy: Galaxy,
    metrics: list[Path],
    names: list[str],
    timeout: float,
    sample: Callable[[], dict] | None = None,
) -> list[dict[int, dict]]:
    """Each cluster's records by step, each with ``seen``: when its line appeared (monotonic seconds); the
    first cluster's also with what ``sample()`` returned then (the lab's link counters, say)."""
    seen: list[dict[int, dict]] = [{} for _ in metrics]
    deadline = time.monotonic() + timeout
    while any(galaxy.procs[name].poll() is None for name in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the clusters did not finish within {timeout} s")
        galaxy.track()
        for records, path in zip(seen, metrics, strict=True):
            if path.exists():
                for record in read_metrics(path):  # (whole lines: the last may still be being written)
                    if record["step"] not in records:
                        extra = sample() if sample is not None and records is seen[0] else {}
                        records[record["step"]] = {**record, "seen": time.monotonic(), **extra}
        time.sleep(0.05)
    for name in names:
        assert galaxy.procs[name].returncode == 0, galaxy.log(name)[-3000:]
    return seen


def by_sync(seen: list[dict[int, dict]]) -> list[dict[int, dict]]:
    """Each cluster's sync records by outer step (from its records by step)."""
    return [{r["outer_step"]: r for r in records.values() if "outer_step" in r} for records in seen]


def steady_rounds(seen: list[dict[int, dict]], clusters: int, rounds: int) -> list[dict]:
    """Cluster 0's records of the round before the steady ones (where the wall clock starts) and of the
    ``rounds`` steady rounds: whole rounds (every cluster took part, equal hashes),
    after the first whole one (it also waits for the slowest start) and before the run's last (see the module
    docstring). With 4 clusters on 2 cores one often starts late and adopts the galaxy's state: the rounds
    before it arrived are not steady."""
    by_round = by_sync(seen)
    last = min(max(rounds_of) for rounds_of in by_round)
    whole = [
        k
        for k in sorted(by_round[0])
        if k < last
        and all(
            k in rounds_of
            and rounds_of[k]["galaxy_peers"] == clusters
            and rounds_of[k]["param_hash"] == by_round[0][k]["param_hash"]
            for rounds_of in by_round
        )
    ]
    steady = whole[1 : rounds + 1]
    if (
        len(steady) < rounds
        or steady != list(range(steady[0], steady[0] + rounds))
        or steady[0] - 1 not in by_round[0]
    ):
        raise AssertionError(
            f"expected {rounds} consecutive whole rounds after the first, got rounds {whole} "
            f"of {sorted(by_round[0])}; run more rounds (--rounds) or fewer clusters"
        )
    return [by_round[0][k] for k in range(steady[0] - 1, steady[-1] + 1)]


def link_sample(lab: Lab) -> dict:
    """The counters of cluster 0's link and of the DHT's, as :func:`watch` attaches them to a record."""
    return {"link": lab.link_bytes("c0"), "dht_link": lab.link_bytes("dht")}


def link_figures(before: dict, steady: list[dict]) -> dict:
    """Medians over the steady rounds of what cluster 0's link carried between one sync's record and the
    next (both directions, every process of the cluster, headers and retransmissions included), of that ÷ the
    bytes the round logged (``bytes_sent`` + ``bytes_received``: encoded tensor parts), and of what the DHT's
    link carried meanwhile (matchmaking lookups and the status records, from every cluster)."""
    link, logged, dht = [], [], []
    for previous, record in zip([before, *steady], steady, strict=False):
        link.append(sum(record["link"]) - sum(previous["link"]))
        dht.append(sum(record["dht_link"]) - sum(previous["dht_link"]))
        logged.append(record["bytes_sent"] + record["bytes_received"])
    return {
        "link_mb": statistics.median(link) / 1e6,
        "link_ratio": statistics.median(a / b for a, b in zip(link, logged, strict=True)),
        "dht_link_mb": statistics.median(dht) / 1e6,
    }


def split_figures(seen: list[dict[int, dict]], steady: list[dict], wire: list[float]) -> dict:
    """Medians over the steady rounds of the round's two parts (cluster 0's), of their sum and of the exchange
    ÷ the wire bound, and of the matchmaking of the cluster that arrived last."""
    syncs = by_sync(seen)
    last = [min(records[r["outer_step"]]["matchmaking_seconds"] for records in syncs) for r in steady]
    sync = [r["matchmaking_seconds"] + r["exchange_seconds"] for r in steady]
    return {
        "matchmaking_s": statistics.median(r["matchmaking_seconds"] for r in steady),
        "matchmaking_last_s": statistics.median(last),
        "exchange_s": statistics.median(r["exchange_seconds"] for r in steady),
        "sync_ratio": statistics.median(a / w for a, w in zip(sync, wire, strict=True)),
        "exchange_ratio": statistics.median(
            r["exchange_seconds"] / w for r, w in zip(steady, wire, strict=True)
        ),
    }
