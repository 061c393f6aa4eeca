"""How ``open-diloco ledger`` reads, checks and shows the galaxy's ledger (pure: no DHT, no torch).

Sources: each cluster's jsonl metrics (a round's record carries its ``ledger`` entry and its ``param_hash``),
checkpoints (``ledger.jsonl`` beside ``metadata.json``, which names the θ's ``param_hash``), or the entries a
live galaxy mirrors in its DHT. What a check refuses, each in one line (:func:`verify`):

- an entry whose content does not match its hash, or a record whose ``param_hash`` is not its entry's
  ``after`` (a record altered after it was written);
- a cluster's chain that does not continue: a round it committed (``applied`` or ``adopted``) that does not
  start from the θ its previous round ended at, within one launch (a resume or a re-sync starts afresh);
- a cluster whose final θ is not its last entry's ``after``;
- a checkpoint whose ledger does not continue, or does not end at the θ the checkpoint holds, or (with metrics
  of its round given) whose θ no cluster committed at its outer step.

Forks (two entries for one round: a partition, a cluster that applied its Δ alone) are shown, not refused:
they are what the ledger exists to show, and healing them is the round protocol's job.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from open_diloco.errors import ConfigError
from open_diloco.outer.ledger import CHECKPOINT_FILE, LedgerEntry, read_checkpoint_ledger

COMMITS = ("applied", "adopted")
"""Outcomes whose entry continues the cluster's own chain (a re-sync starts it afresh from a source's)."""


@dataclass
class Held:
    """One record of a cluster that names an entry: the round's outcome there, and where it was read."""

    entry: LedgerEntry
    outcome: str
    param_hash: str | None
    where: str
    segment: int
    """Counts the cluster's fresh starts (a launch, a re-sync that brought no chain): a chain continues within
    one segment."""


@dataclass
class ClusterLedger:
    """What one cluster's metrics say of the chain it held."""

    name: str
    held: list[Held] = field(default_factory=list)
    final_hash: str | None = None
    """The last ``param_hash`` the cluster logged (its θ at the end)."""
    final_segment: int = 0


@dataclass
class CheckpointLedger:
    path: Path
    outer_step: int
    param_hash: str | None
    entries: list[LedgerEntry]


def read_sources(inputs: list[Path]) -> tuple[list[ClusterLedger], list[CheckpointLedger]]:
    """Every cluster's metrics file and every checkpoint ``inputs`` name (files, or directories searched below
    them); one line naming the path when there is neither, or a file is not what it claims."""
    metrics: list[Path] = []
    checkpoints: list[Path] = []
    for path in inputs:
        if path.is_file() and path.name != CHECKPOINT_FILE:
            metrics.append(path)
        elif path.is_dir():
            metrics += sorted(p for p in path.rglob("*.jsonl") if p.name != CHECKPOINT_FILE)
            checkpoints += sorted(
                p.parent for p in path.rglob("metadata.json") if (p.parent / ".metadata").is_file()
            )
        else:
            raise ConfigError(
                f"{path} does not exist: give a run's directory, its metrics files or checkpoints"
            )
    if not metrics and not checkpoints:
        raise ConfigError(
            f"{', '.join(map(str, inputs))} hold no metrics (*.jsonl) and no checkpoint: give the run's "
            "directory, the files of --metrics-path or the --ckpt.path directories"
        )
    return [read_cluster(path) for path in dict.fromkeys(metrics)], [
        read_checkpoint(path) for path in dict.fromkeys(checkpoints)
    ]


def read_cluster(path: Path) -> ClusterLedger:
    """The entries one metrics file's round records name, in file order (launches counted by ``start``)."""
    cluster = ClusterLedger(name=path.stem)
    segment = 0
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"{path}:{number} is not a JSON record: is this open-diloco metrics?") from None
        fields = record.get("ledger")
        if record.get("event") == "start" or (record.get("resynced") and not isinstance(fields, dict)):
            segment += 1
        if record.get("event") == "start":
            rank = ((record.get("config") or {}).get("hv") or {}).get("world_rank")
            cluster.name = f"cluster {rank}" if rank is not None else cluster.name
        if isinstance(record.get("param_hash"), str) and "outer_step" in record:
            cluster.final_hash, cluster.final_segment = record["param_hash"], segment
        if isinstance(fields, dict):
            where = f"{path}:{number}"
            entry = LedgerEntry.from_wire(fields, where)
            outcome = str(record.get("round_outcome", "applied"))
            cluster.held.append(Held(entry, outcome, record.get("param_hash"), where, segment))
    return cluster


def read_checkpoint(path: Path) -> CheckpointLedger:
    metadata = json.loads((path / "metadata.json").read_text())
    entries = [
        LedgerEntry.from_wire(fields, f"{path / CHECKPOINT_FILE} entry {i + 1}")
        for i, fields in enumerate(read_checkpoint_ledger(path))
    ]
    return CheckpointLedger(path, int(metadata.get("outer_step", 0)), metadata.get("param_hash"), entries)


def verify(clusters: list[ClusterLedger], checkpoints: list[CheckpointLedger]) -> list[str]:
    """Every break the sources show, one line each (empty: the chains hold); see the module docstring."""
    problems: list[str] = []
    for cluster in clusters:
        previous: Held | None = None
        for held in cluster.held:
            if held.param_hash is not None and held.param_hash != held.entry.after:
                problems.append(
                    f"{held.where}: param_hash {held.param_hash} is not its ledger entry's after "
                    f"{held.entry.after} (round {held.entry.round}): the record was altered"
                )
            continues = previous is not None and previous.segment == held.segment and held.outcome in COMMITS
            if continues and held.entry.before != previous.entry.after:
                problems.append(
                    f"{held.where}: {cluster.name}'s chain breaks at round {held.entry.round}: it starts "
                    f"from θ {held.entry.before}, its previous round ({previous.entry.round}) ended at "
                    f"{previous.entry.after}"
                )
            previous = held
        ends_there = previous is not None and previous.segment == cluster.final_segment
        if ends_there and cluster.final_hash not in (None, previous.entry.after):
            problems.append(
                f"{cluster.name} ends on θ {cluster.final_hash}, not its last ledger entry's "
                f"{previous.entry.after} (round {previous.entry.round})"
            )
    committed = {(held.entry.round, held.entry.after) for c in clusters for held in c.held}
    for ckpt in checkpoints:
        problems += _checkpoint_problems(ckpt, committed if clusters else None)
    return problems


def _checkpoint_problems(ckpt: CheckpointLedger, committed: set[tuple[int, str]] | None) -> list[str]:
    problems = [
        f"{ckpt.path / CHECKPOINT_FILE}: the chain breaks at round {entry.round}: it starts from θ "
        f"{entry.before}, round {previous.round} ended at {previous.after}"
        for previous, entry in zip(ckpt.entries, ckpt.entries[1:], strict=False)
        if entry.before != previous.after
    ]
    last = ckpt.entries[-1] if ckpt.entries else None
    if last is not None and (last.round, last.after) != (ckpt.outer_step, ckpt.param_hash):
        problems.append(
            f"checkpoint {ckpt.path} holds θ {ckpt.param_hash} at outer step {ckpt.outer_step}, but its "
            f"ledger ends at round {last.round} on θ {last.after}"
        )
    rounds_shown = {round_no for round_no, _ in committed or ()}
    if ckpt.outer_step in rounds_shown and (ckpt.outer_step, ckpt.param_hash) not in committed:
        problems.append(
            f"checkpoint {ckpt.path} holds θ {ckpt.param_hash} at outer step {ckpt.outer_step}, which no "
            "cluster's metrics show committed at that round"
        )
    return problems


@dataclass
class GalaxyLedger:
    """Every distinct entry the sources hold, by round, with who holds each; the chain the galaxy ended on."""

    by_round: dict[int, dict[str, LedgerEntry]]
    holders: dict[str, set[str]]
    chain: list[LedgerEntry]
    """Walked back from the top round's most-held entry by ``before`` → ``after``, oldest first."""


def galaxy_ledger(clusters: list[ClusterLedger], extra: list[LedgerEntry] = ()) -> GalaxyLedger:
    """Gather the entries (``extra``: those of checkpoints or of the DHT's mirror) and find the chain."""
    by_round: dict[int, dict[str, LedgerEntry]] = defaultdict(dict)
    holders: dict[str, set[str]] = defaultdict(set)
    for cluster in clusters:
        for held in cluster.held:
            by_round[held.entry.round][held.entry.hash] = held.entry
            holders[held.entry.hash].add(cluster.name)
    for entry in extra:
        by_round[entry.round].setdefault(entry.hash, entry)
    chain: list[LedgerEntry] = []
    if by_round:
        top = max(by_round)
        entry = max(by_round[top].values(), key=lambda e: (len(holders[e.hash]), len(e.members), e.hash))
        while entry is not None:
            chain.append(entry)
            below = by_round.get(entry.round - 1, {}).values()
            entry = next((e for e in below if e.after == entry.before), None)
    return GalaxyLedger(dict(by_round), dict(holders), chain[::-1])


def chain_problems(galaxy: GalaxyLedger) -> list[str]:
    """The galaxy chain's gaps: a round between its first and last with no entry that continues it."""
    if not galaxy.chain:
        return []
    first = galaxy.chain[0].round
    earlier = [r for r in galaxy.by_round if r < first]
    if not earlier:
        return []
    return [
        f"the galaxy's chain stops at round {first}: no entry of round {first - 1} ends at the θ it starts "
        f"from ({galaxy.chain[0].before}), though entries of rounds {min(earlier)}–{max(earlier)} exist"
    ]


def render(galaxy: GalaxyLedger, rounds: int) -> list[str]:
    """The summary, the forks, and the last ``rounds`` rounds of the chain: what an operator reads first."""
    chain = galaxy.chain
    if not chain:
        return ["no ledger entries (the run committed no round, or predates the ledger)"]
    on_chain = {entry.hash for entry in chain}
    sizes = [len(entry.members) for entry in chain]
    retried = [entry.round for entry in chain if entry.attempt]
    lines = [
        f"chain: rounds {chain[0].round}–{chain[-1].round} ({len(chain)} entries), ending at θ "
        f"{chain[-1].after}; "
        f"{sum(s == max(sizes) for s in sizes)} rounds of {max(sizes)} clusters, "
        f"{sum(s < max(sizes) for s in sizes)} with fewer; {len(retried)} committed on a retry"
        + (f"; committed work {chain[-1].work} tokens" if chain[-1].work is not None else "")
    ]
    for round_no, entries in sorted(galaxy.by_round.items()):
        if len(entries) > 1:
            shown = "; ".join(
                f"{e.hash[:8]} {e.before[:8]}→{e.after[:8]} members {e.ranks}"
                + (" alone" if e.alone else "")
                + (f" work {e.work}" if e.work is not None else "")
                + f" held by {', '.join(sorted(galaxy.holders.get(e.hash, ())) or ['the DHT'])}"
                + (" (on the chain)" if e.hash in on_chain else "")
                for e in entries.values()
            )
            lines.append(f"fork at round {round_no}: {len(entries)} entries: {shown}")
    lines.append(
        f"{'round':>6} {'att':>3} {'frag':>4}  {'before':<16} {'after':<16}  members (rank:weight)  codec"
    )
    for entry in chain[-rounds:]:
        members = " ".join(f"{m.rank}:{m.weight:g}" for m in entry.members)
        lines.append(
            f"{entry.round:>6} {entry.attempt:>3} {entry.fragment:>4}  {entry.before:<16} {entry.after:<16}  "
            f"{members:<21}  {entry.codec}{' (alone)' if entry.alone else ''}"
        )
    return lines


def entries_from_wire(values: list[dict[str, Any]], where: str) -> list[LedgerEntry]:
    """Entries read from the DHT's mirror; one that does not match its hash is a ``LedgerBroken``."""
    return [LedgerEntry.from_wire(value, where) for value in values]
