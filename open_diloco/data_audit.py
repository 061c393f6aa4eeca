"""What became of the data each cluster read: every page committed into θ_outer once, lost, or taken twice.

Why: the data plan says which samples a cluster should train, and ``tokens_committed`` counts tokens; neither
says whether a given sample reached θ_outer, or reached it twice (a stride trained again after a held round, a
resumed cluster training again what its killed launch had already put in). This audit reads what happened:
the samples the loaders handed to the model (``--sample-log``, ``open_diloco/sample_log.py``) and the
clusters' sync records (``--metric-logger-type jsonl``), lined up by their ``time``.

- **Page**: one inner step's samples of one cluster (every rank's micro-batches of that step), named by the
  loader's position ``inner_steps`` (1, 2, …). The fixed roster deals the data by position
  (``data.split_samples``), so a cluster's pages below its highest one are all its data so far.
- **A reading** of a page is one training of it. A cluster's training moves every fragment of θ_local, and
  fragment f carries a reading into θ_outer with f's first sync that *starts* after it (a record's
  ``sync_step``: at ``--hv.sync-delay`` τ > 0, the τ steps trained while a sync is in flight belong to the
  fragment's next one).
- **That sync commits the reading for f** when its outcome is ``applied`` or ``adopted`` with this cluster a
  member of its ledger entry (else it is lost for f). Every reading in progress is lost, for every fragment,
  when the sync ``held`` or was ``sat_out`` (θ_local goes back to θ_outer, every fragment of it) or the
  cluster took another's state (``resynced``); a later re-sync that drops the round (``ledger_dropped``: a
  fork not kept) takes its commits back. A launch that ends (killed, stopped) loses its readings not yet
  committed, except, when the next launch resumed from a checkpoint, those before the step it goes on from.
- **A page is committed once** when each fragment's θ_outer took exactly one of its readings. *Lost*: some
  fragment took none, and none is still in flight at the end. *Twice*: some fragment took two.
- Across clusters (real data, where a sample id is global): a sample in pages of two clusters that both
  committed is counted twice by the galaxy.
- **An elastic galaxy** (the ledger deals pages of one galaxy-wide order: ``outer/deal.py``): a page is the
  galaxy's (the sample log's ``page``), a cluster's lost page is no loss while the deal gives it back, and
  the audit is galaxy-wide (:class:`DealtPages`): every page below the final deal's cursor committed by
  exactly one reading, or still in flight by that deal (its queue, its unsettled hands); and the pages the
  ledger entries say they committed are exactly those the readings show committed.

A resumed launch that goes on past its checkpoint's step took the galaxy's state as it joined (no sync record
says so): what its checkpoint held is lost too.

Pure Python: no torch, no hivemind.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TAKES = ("resynced",)
"""Outcomes after which this cluster's θ_local is another cluster's: every reading in progress is lost."""
DROPS = {"held": "held", "sat_out": "sat out"}
"""Outcomes after which θ_local is θ_outer again, every fragment of it (``OuterState.drop_progress``; a bad
Δ's own state): every reading in progress is lost."""
CAUSES = ("held", "sat out", "left out", "taken", "dropped fork", "launch ended", "never read")
"""Why a page was lost, as :attr:`ClusterPages.causes` counts them: its fragment's sync held or was sat out,
committed without this cluster, the cluster took another's state, a later heal dropped the round, the launch
died before the sync, or no loader ever read it (a take moved the loader past it)."""


@dataclass
class Reading:
    """One training of a page by a cluster."""

    step: int
    page: int
    ids: list[int]
    commits: dict[int, list[int]] = field(default_factory=dict)
    """Fragment → the rounds that carried this reading into θ_outer (a dropped round taken out again)."""
    lost: dict[int, str] = field(default_factory=dict)
    """Fragment → why this reading did not reach it (:data:`CAUSES`)."""

    def lose(self, fragment: int, cause: str) -> None:
        self.lost[fragment] = cause


@dataclass(frozen=True)
class ClusterPages:
    """One cluster's pages, by what became of them."""

    galaxy_rank: int
    cursor: int
    """The highest page it read."""
    read: int
    once: list[int]
    lost: list[int]
    """Pages at or below the cursor (read or skipped) that some fragment never took, none in flight."""
    twice: list[int]
    in_flight: list[int]
    """Pages with a reading still uncommitted when the cluster's last launch ended (the run's last sync)."""
    skipped: list[int]
    """Pages below the cursor never read (a take moved the loader past them); counted in :attr:`lost` too."""
    causes: dict[str, int] = field(default_factory=dict)
    """Lost pages by why (:data:`CAUSES`; a page trained twice and lost both times, by its last training)."""


@dataclass(frozen=True)
class DealtPages:
    """An elastic galaxy's pages, galaxy-wide (see the module doc)."""

    cursor: int
    """The final deal's first page never dealt."""
    once: int
    """Pages below the cursor committed by exactly one reading."""
    lost: list[int]
    """Pages below the cursor that no reading committed and the final deal does not hold in flight."""
    twice: list[int]
    """Pages committed by two readings (of one cluster or two)."""
    in_flight: list[int]
    """Pages the final deal holds: its queue, and hands not yet settled."""
    unmatched: list[int]
    """Pages the ledger entries and the readings disagree on (committed by one, not the other)."""
    fragment_twice: list[int] = field(default_factory=list)
    """Pages some fragment took from two readings: committed into part of the model, then (some covering
    round not carrying it) given back and trained again whole. Not a page committed twice (that needs every
    fragment), but those fragments saw its samples twice: the deal's price for never losing a page."""


@dataclass(frozen=True)
class GalaxyPages:
    clusters: list[ClusterPages]
    shared_ids: list[int]
    """Real data: sample ids committed in pages of two clusters (empty for fake data: its streams are the
    clusters' own)."""
    dealt: DealtPages | None = None
    """An elastic galaxy's galaxy-wide account; ``None`` for a fixed one."""

    @property
    def problems(self) -> list[str]:
        """One line per cluster with pages lost or twice (a fixed galaxy; an elastic one: one line for the
        galaxy's pages), and one for shared samples."""
        lines = [
            f"cluster {c.galaxy_rank}: {len(c.lost)} page(s) lost (first {c.lost[:5]}), {len(c.twice)} taken "
            f"twice (first {c.twice[:5]}), of {c.cursor}"
            for c in self.clusters
            if (c.lost or c.twice) and self.dealt is None
        ]
        if (d := self.dealt) is not None and (d.lost or d.twice or d.unmatched):
            lines.append(
                f"the galaxy: {len(d.lost)} page(s) lost (first {d.lost[:5]}), {len(d.twice)} committed "
                f"twice (first {d.twice[:5]}), {len(d.unmatched)} the ledger and the readings disagree on "
                f"(first {d.unmatched[:5]}), below the cursor {d.cursor}"
            )
        if self.shared_ids:
            first = self.shared_ids[:5]
            lines.append(f"{len(self.shared_ids)} sample(s) committed by two clusters (first {first})")
        return lines


def audit(sample_log: Path, metrics: list[Path]) -> GalaxyPages:
    """Audit the clusters whose jsonl metrics files are ``metrics`` against the ``--sample-log`` directory."""
    lines_by_cluster: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(Path(sample_log).glob("*.rank*.jsonl")):
        for line in _whole_lines(path):
            lines_by_cluster[line["galaxy_rank"]][line["rank"]].append(line)
    clusters, fake, committed_ids = [], True, defaultdict(set)
    dealt, readers, read, entries, parts = False, Counter(), set(), [], Counter()
    for path in metrics:
        records = _whole_lines(path)
        starts = [r for r in records if r.get("event") == "start"]
        if not starts:
            continue
        config = starts[0]["config"]
        fake = bool(config.get("fake_data", True))
        hv = config.get("hv") or {}
        rank, fragments = hv.get("world_rank", 0), int(hv.get("fragments", 1))
        dealt = dealt or hv.get("cluster_id") is not None
        readings = _readings(lines_by_cluster.get(rank, {}))
        delay = int(hv.get("sync_delay", 0))
        pages, every = _replay(readings, records, rank, fragments, delay, hv.get("cluster_id") is not None)
        clusters.append(pages)
        entries += [r["ledger"] for r in records if r.get("ledger")]
        for reading in every:
            read.add((reading.page, rank))
            parts.update((reading.page, f) for f, rounds in reading.commits.items() for _ in rounds)
            if all(reading.commits.get(f) for f in range(fragments)):  # committed into every fragment
                readers[(reading.page, rank)] += 1
                for sample in reading.ids:
                    committed_ids[sample].add(rank)
    shared = [] if fake else sorted(i for i, ranks in committed_ids.items() if len(ranks) > 1)
    return GalaxyPages(clusters, shared, _dealt_pages(readers, read, entries, parts) if dealt else None)


def _dealt_pages(readers: Counter, read: set, entries: list[dict[str, Any]], parts: Counter) -> DealtPages:
    """The galaxy-wide account of an elastic galaxy's pages: what the chain the galaxy ended on committed
    (the entry with the most work and its ancestors by θ hash; its final deal) against the readings: every
    page the chain committed read by its committer (``read``: (page, cluster) of every reading), and every
    reading its cluster's records show committed (``readers``: (page, cluster) → how many) in the chain. A
    reading its records do not settle (the cluster was killed before it logged the round) may still be in
    the chain: its Δ had gone out."""
    from open_diloco.outer.deal import Deal, from_ranges

    # the parent of entry r: entry r − 1 that ended at its θ (by round too: a round whose Δs were all zero,
    # every member without a page, leaves θ as it was, so an "after" alone may name two rounds)
    by_after = {(entry["after"], entry["round"]): entry for entry in entries}
    final = max(entries, key=lambda e: (e.get("work") or 0, e["round"]), default=None)
    chain = []
    while final is not None:
        chain.append(final)
        final = by_after.get((final["before"], final["round"] - 1))
    deal = Deal.from_wire(chain[0]["deal"]) if chain and chain[0].get("deal") else Deal()
    in_ledger = Counter(
        (page, int(rank))
        for entry in chain
        for rank, runs in (entry.get("pages") or {}).items()
        for page in from_ranges(runs)
    )
    per_page = Counter()
    for (page, _), count in in_ledger.items():
        per_page[page] += count
    flying = deal.in_flight
    unread = {page for page, rank in in_ledger if (page, rank) not in read}
    unledgered = {page for page, rank in readers if (page, rank) not in in_ledger}
    twice = {page for page, count in per_page.items() if count > 1}
    twice |= {page for (page, _), count in readers.items() if count > 1}
    return DealtPages(
        cursor=deal.cursor,
        once=sum(1 for page in range(deal.cursor) if per_page[page] == 1),
        lost=[page for page in range(deal.cursor) if per_page[page] == 0 and page not in flying],
        twice=sorted(twice),
        in_flight=sorted(flying),
        unmatched=sorted(unread | unledgered),
        fragment_twice=sorted({page for (page, _), count in parts.items() if count > 1} - twice),
    )


def _whole_lines(path: Path) -> list[dict[str, Any]]:
    text = Path(path).read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def _readings(by_rank: dict[int, list[dict[str, Any]]]) -> list[tuple[float, Reading]]:
    """A cluster's readings in the order trained: its lowest rank's lines, with every rank's ids of each."""
    if not by_rank:
        return []
    ranks = sorted(by_rank)
    first = by_rank[ranks[0]]
    readings = []
    for index, line in enumerate(first):
        ids = [i for rank in ranks if index < len(by_rank[rank]) for i in by_rank[rank][index]["sample_ids"]]
        page = line.get("page", line["inner_steps"])  # an elastic galaxy's: the page the ledger dealt
        readings.append((line["time"], Reading(line["step"], page, ids)))
    return readings


def _replay(
    readings: list[tuple[float, Reading]],
    records: list[dict[str, Any]],
    rank: int,
    fragments: int,
    delay: int,
    dealt: bool = False,
) -> tuple[ClusterPages, list[Reading]]:
    """Walk a cluster's readings and records in time order, settling each reading fragment by fragment."""
    events = [(t, 0, "read", r) for t, r in readings]
    marks = [r for r in records if "round_outcome" in r or r.get("event") in ("start", "took_state")]
    events += [(r["time"], 1, "record", r) for r in marks]
    events.sort(key=lambda e: (e[0], e[1]))
    pending: dict[int, list[Reading]] = {f: [] for f in range(fragments)}
    every: list[Reading] = []
    by_round: dict[int, list[tuple[Reading, int]]] = defaultdict(list)
    resumed_at: int | None = None
    for _, _, kind, item in events:
        if kind == "read":
            if resumed_at is not None:  # a new launch: its checkpoint's readings go on, later ones are lost
                pending = _lose(pending, "launch ended", keep=lambda r, step=resumed_at: r.step <= step)
                if item.step > resumed_at + 1:  # it went on past its checkpoint: it took the galaxy's state
                    pending = _lose(pending, "taken")
                resumed_at = None
            every.append(item)
            for f in range(fragments):
                pending[f].append(item)
        elif item.get("event") == "took_state":  # joined by the galaxy's state: θ_local is another's
            pending = _lose(pending, "taken")
        elif item.get("event") == "start":
            if every:  # the previous launch ended here
                resumed_at = _checkpoint_step(item.get("resumed_from"))
                if resumed_at is None:
                    pending = _lose(pending, "launch ended")
        else:
            pending = _settle(item, pending, delay, rank, by_round)
    flight = sorted({r.page for rs in pending.values() for r in rs})
    return _pages(rank, every, fragments, flight, dealt), every


def _checkpoint_step(path: str | None) -> int | None:
    """The inner step of a checkpoint directory (``checkpoint.step_dir``: ``step_<N>``), ``None`` for none."""
    found = re.search(r"step_(\d+)$", str(path).rstrip("/")) if path else None
    return int(found.group(1)) if found else None


def _settle(
    record: dict[str, Any],
    pending: dict[int, list[Reading]],
    delay: int,
    rank: int,
    by_round: dict[int, list[tuple[Reading, int]]],
) -> dict[int, list[Reading]]:
    """One sync record's effect on the readings in progress; returns those still in progress."""
    if (dropped := record.get("ledger_dropped")) is not None:
        first, last = dropped["rounds"]
        for number in range(first, last + 1):
            for reading, fragment in by_round.pop(number, []):
                reading.commits[fragment].remove(number)
                reading.lose(fragment, "dropped fork")
    fragment, outcome = record.get("fragment", 0), record["round_outcome"]
    if outcome in TAKES or (outcome == "sat_out" and record.get("state_source") is not None):
        return _lose(pending, "taken")
    if outcome in DROPS:  # θ_local went back to θ_outer, every fragment of it
        return _lose(pending, DROPS[outcome])
    started_at = record.get("sync_step", record["step"] - delay)  # (records before ``sync_step``: by τ)
    waiting = pending[fragment]
    ends = [i for i, r in enumerate(waiting) if r.step == started_at]
    cut = ends[-1] + 1 if ends else sum(1 for r in waiting if r.step <= started_at)
    covered, pending[fragment] = waiting[:cut], waiting[cut:]
    entry = record.get("ledger") or {}
    member = rank in [m["rank"] for m in entry.get("members", [])]
    if outcome in ("applied", "adopted") and member:
        for reading in covered:
            reading.commits.setdefault(fragment, []).append(entry["round"])
            by_round[entry["round"]].append((reading, fragment))
    else:
        for reading in covered:
            reading.lose(fragment, "left out")
    return pending


def _lose(
    pending: dict[int, list[Reading]], cause: str, keep: Callable[[Reading], bool] = lambda r: False
) -> dict[int, list[Reading]]:
    """Readings in progress lost for ``cause`` (all but those ``keep`` keeps); returns those kept."""
    for fragment, readings in pending.items():
        for reading in readings:
            if not keep(reading):
                reading.lose(fragment, cause)
    return {fragment: [r for r in readings if keep(r)] for fragment, readings in pending.items()}


def _pages(
    rank: int, every: list[Reading], fragments: int, in_flight: list[int], dealt: bool = False
) -> ClusterPages:
    """A cluster's pages by what became of them: every page up to the highest it read (its own part), or in
    an elastic galaxy the pages it read (the deal gave it those)."""
    taken: dict[int, list[int]] = defaultdict(lambda: [0] * fragments)
    for reading in every:
        for f in range(fragments):
            taken[reading.page][f] += len(reading.commits.get(f, []))
    cursor = max((r.page for r in every), default=0)
    flying = set(in_flight)
    last_loss = {r.page: r.lost for r in every if r.lost}  # (readings in order: the last one wins)
    once, lost, twice, causes = [], [], [], Counter()
    for page in sorted({r.page for r in every}) if dealt else range(1, cursor + 1):
        counts = taken.get(page, [0] * fragments)
        if any(c > 1 for c in counts):
            twice.append(page)
        elif all(c == 1 for c in counts):
            once.append(page)
        elif page not in flying:
            lost.append(page)
            missing = [last_loss.get(page, {}).get(f) for f, c in enumerate(counts) if c == 0]
            causes[next((why for why in missing if why), "never read")] += 1
    skipped = [] if dealt else [p for p in range(1, cursor + 1) if p not in taken]
    return ClusterPages(rank, cursor, len(taken), once, lost, twice, sorted(flying), skipped, dict(causes))
