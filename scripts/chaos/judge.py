"""The soak's verdict: the figures of analysis.py, the clusters' logs and exit codes, and issue 34's targets
(each printed with its value, so a failed soak says which promise broke and by how much)."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from open_diloco.ledger_view import read_cluster, verify
from scripts.chaos.analysis import (
    REPAIR_LIMIT,
    RESYNC_SHARE_LIMIT,
    RETRY_SHARE_LIMIT,
    cluster_figures,
    fault_figures,
    galaxy_goodput,
    hashes_by_step,
    windows,
)
from scripts.chaos.plan import CUTS, Fault, minority_of

NOTABLE = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL)\b|Traceback|stopping:|training stopped")
OUR_PREFIX = re.compile(r"^\S+ \S+ (WARN|WARNING|ERROR|CRITICAL) galaxy_rank=\d+ rank=\d+ local_rank=\d+ ")
PEER_ID = re.compile(r"\b(?:12D3KooW|Qm)[1-9A-HJ-NP-Za-km-z]{20,}")
NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\b[0-9a-fA-F]{12,}\b|\d+(?:\.\d+)?")


def normalize(line: str) -> str:
    """A log line as a kind of line: no time, ranks or numbers (so 200 partial rounds count as one kind)."""
    line = OUR_PREFIX.sub(r"\1 ", line.strip())
    line = re.sub(r"^\[?[A-Z][a-z]{2} \d+ [\d:.]+\]? ", "", line)  # hivemind's own time stamp
    return NUMBERS.sub("N", PEER_ID.sub("PEER", line))[:220]


def read_logs(launches: list[dict], out: Path) -> tuple[Counter, dict[int, list[str]]]:
    """Kinds of notable lines over every launch's log (``Launch.to_json()``, logs under ``out``), and each
    cluster's "stopping" lines from launches the soak did not end itself."""
    kinds: Counter = Counter()
    stops: dict[int, list[str]] = {}
    for launch in launches:
        log = out / launch["log"]
        if not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            if NOTABLE.search(line):
                kinds[normalize(line)] += 1
            if not launch["killed"] and ("stopping:" in line or "training stopped" in line):
                stops.setdefault(launch["cluster"], []).append(line.strip()[:300])
    return kinds, stops


def judge(
    faults: list[Fault],
    syncs: list[list[dict]],
    launches: list[dict],
    out: Path,
    hung: bool,
    left_running: list[dict],
) -> dict:
    """Every figure of the summary and the verdict on each target (``launches``: ``Launch.to_json()``
    each)."""
    syncs = by_cluster_number(syncs, out)
    table = hashes_by_step(syncs)
    spans = windows(faults, syncs)
    fault_rows = fault_figures(faults, syncs, table)
    repairs = {
        (row["index"], int(c)): (r[0] if r else None)
        for row in fault_rows
        for c, r in row.get("repair_by_cluster", {}).items()
    }
    clusters = [cluster_figures(c, records, spans, repairs, table) for c, records in enumerate(syncs)]
    kinds, stops = read_logs(launches, out)
    for c, fig in enumerate(clusters):
        exits = [
            launch["returncode"] for launch in launches if launch["cluster"] == c and not launch["killed"]
        ]
        fig["exit_codes"] = exits
        fig["stopped"] = any(code not in (0, None) for code in exits) or bool(stops.get(c))
        fig["stopping_lines"] = stops.get(c, [])[:5]
        fig["launches"] = sum(launch["cluster"] == c for launch in launches)
        fig["left"] = any(f.kind == "leave" and f.fired and f.cluster == c for f in faults)
    pages = audit_pages(out, len(syncs))
    return {
        "pages": pages,
        "clusters": clusters,
        "faults": fault_rows,
        "log_lines": [{"count": n, "line": line} for line, n in kinds.most_common(25)],
        "acceptance": targets(
            clusters,
            fault_rows,
            hung,
            left_running,
            ledger_breaks(out, len(syncs)),
            minority_taken(faults, syncs),
            lighter_taken(syncs),
            sum(bool(r.get("ledger_dropped")) for records in syncs for r in records),
        )
        + elastic_rows(pages, clusters),
    }


GOODPUT_GOAL = 0.9
"""Issue 50's goal for an elastic soak: tokens committed ÷ computed over the galaxy, with its faults."""


def by_cluster_number(syncs: list[list[dict]], out: Path) -> list[list[dict]]:
    """The clusters' syncs with ``state_source`` (a galaxy rank) as the soak's cluster number: the same in a
    fixed soak, the rank of an id in an elastic one (each cluster's first record says its rank)."""
    number = {}
    for c in range(len(syncs)):
        path = out / f"cluster{c}.jsonl"
        first = ""
        if path.exists():
            with path.open() as metrics:  # (its first record: the launch's start)
                first = metrics.readline()
        if first.strip():
            number[json.loads(first)["config"]["hv"]["world_rank"]] = c
    return [
        [{**r, "state_source": number.get(r.get("state_source"), r.get("state_source"))} for r in records]
        for records in syncs
    ]


def audit_pages(out: Path, clusters: int) -> dict | None:
    """An elastic soak's pages (``open_diloco/data_audit.py``) from the samples its loaders read
    (``out/samples``); ``None`` for a fixed soak."""
    from open_diloco.data_audit import audit

    if not (out / "samples").is_dir():
        return None
    dealt = audit(out / "samples", [out / f"cluster{c}.jsonl" for c in range(clusters)]).dealt
    if dealt is None:
        return None
    return {**asdict(dealt), "in_flight": len(dealt.in_flight)}


def elastic_rows(pages: dict | None, clusters: list[dict]) -> list[dict]:
    """An elastic soak's targets: its pages dealt by the ledger, each committed once, and its goodput."""
    if pages is None:
        return []
    goodput = galaxy_goodput(clusters)
    bad = len(pages["lost"]) + len(pages["twice"]) + len(pages["unmatched"])
    rows = [
        (
            "every page below the final cursor committed once or in flight by the final deal "
            "(from the samples read)",
            f"{pages['once']} once, {len(pages['lost'])} lost, {len(pages['twice'])} twice, "
            f"{pages['in_flight']} in flight, {len(pages['unmatched'])} ledger ≠ readings, "
            f"of {pages['cursor']} ({len(pages.get('fragment_twice', []))} taken twice by a fragment)",
            not bad,
        ),
        (
            f"galaxy goodput ≥ {GOODPUT_GOAL:.0%}",
            "-" if goodput is None else f"{goodput:.1%}",
            goodput is not None and goodput >= GOODPUT_GOAL,
        ),
    ]
    return [{"target": t, "value": v, "passed": bool(ok)} for t, v, ok in rows]


HEAL_SECONDS = 120.0
"""After a partition ends: how long a re-sync onto the cut-off cluster still counts as the heal's."""


def minority_taken(faults: list[Fault], syncs: list[list[dict]]) -> list[str]:
    """Issue 49's rule, where a cut leaves some clusters without a quorum (one cluster of three or more cut
    off, or a split's side without rank 0: ``plan.minority_of``): no cluster of the majority re-syncs onto a
    state of the minority's, during the cut or in the heal after it (the majority's work is kept;
    ``outer/quorum.py``). A re-sync onto a θ a majority cluster reached by itself (the majority's, which a
    minority cluster took first) breaks nothing. Each breach: ``#fault: cluster c took cluster k's state at
    outer step s``."""
    taken = []
    for f in faults:
        if f.kind not in CUTS or not f.fired or len(syncs) < 3:
            continue
        minority = set(minority_of(f, len(syncs), faults))

        def onto_it(record: dict, cut: set[int] = minority) -> bool:
            return bool(record.get("resynced")) and record.get("state_source") in cut

        majority = [(c, records) for c, records in enumerate(syncs) if c not in minority]
        reached = {  # (outer step, hash) the majority's clusters reached without the minority
            (r["outer_step"], r.get("param_hash"))
            for _, records in majority
            for r in records
            if not onto_it(r)
        }
        taken += [
            f"#{f.index}: cluster {c} took cluster {r['state_source']}'s state "
            f"at outer step {r['outer_step']}"
            for c, records in majority
            for r in records
            if onto_it(r)
            and f.start <= r["time"] <= f.end + HEAL_SECONDS
            and (r["outer_step"], r.get("param_hash")) not in reached
        ]
    return taken


def lighter_taken(syncs: list[list[dict]]) -> list[str]:
    """Issue 49's rule wherever chains differ (forks included, mid-run and at the end): no cluster takes a
    state whose chain holds less committed work (``committed_work``) than the one it held. Each breach:
    ``cluster c took cluster k's state at outer step s: work w, its own v``."""
    taken = []
    for c, records in enumerate(syncs):
        held = None
        for r in records:
            work = r.get("committed_work")
            if work is None:  # a record of a version before the count
                continue
            if held is not None and r.get("state_source") is not None and work < held:
                taken.append(
                    f"cluster {c} took cluster {r['state_source']}'s state at outer step {r['outer_step']}: "
                    f"work {work}, its own {held}"
                )
            held = work
    return taken


def ledger_breaks(out: Path, clusters: int) -> list[str]:
    """What ``open-diloco ledger --verify`` refuses in the clusters' metrics: a chain that breaks, a round
    or final θ that is not its entry's (``open_diloco/ledger_view.py``)."""
    files = [out / f"cluster{c}.jsonl" for c in range(clusters)]
    return verify([read_cluster(path) for path in files if path.exists()], [])


def targets(
    clusters: list[dict],
    fault_rows: list[dict],
    hung: bool,
    left_running: list[dict],
    ledger: list[str] = (),
    minority: list[str] = (),
    lighter: list[str] = (),
    dropped: int = 0,
) -> list[dict]:
    """Issue 34's acceptance targets, issue 48's (retries, the ledger) and issue 49's (the majority's work
    kept, the heavier fork kept), each ``{"target", "value", "passed"}``."""
    finals = {(c["final_outer_step"], c["final_param_hash"]) for c in clusters if not c.get("left")}
    free = sum(c["syncs_without_fault"] for c in clusters)
    share = sum(c["resynced_without_fault"] for c in clusters) / free if free else 0.0
    streak = max((c["longest_out_of_sync_run_after_faults"] for c in clusters), default=0)
    retried = max((c.get("retried_share_without_fault", 0.0) for c in clusters), default=0.0)
    fired = [f for f in fault_rows if f["fired"] and f.get("syncs_after")]
    slow = [
        f"#{f['index']} {f['kind']}: {f['repair_syncs'] if f['repaired'] else 'never'}"
        for f in fired
        if not f["repaired"] or f["repair_syncs"] > REPAIR_LIMIT
    ]
    stopped = [i for i, c in enumerate(clusters) if c["stopped"]]
    sat = [i for i, c in enumerate(clusters) if c["sat_out_bad_pseudo_grad"] or c["sat_out_without_fault"]]
    rows = [
        (
            "final param_hash equal in every cluster",
            f"{len(finals)} distinct (outer step, hash)",
            len(finals) == 1 and None not in next(iter(finals), (None,)),
        ),
        ("no healthy cluster stopped", f"stopped: {stopped or 'none'}", not stopped),
        (
            "no healthy cluster sat out (bad Δ, or with no fault to blame)",
            f"sat out: {sat or 'none'}",
            not sat,
        ),
        (
            f"out of sync ≤ {REPAIR_LIMIT} syncs in a row after any fault",
            f"longest {streak}",
            streak <= REPAIR_LIMIT,
        ),
        (
            f"every repair within {REPAIR_LIMIT} syncs",
            f"{len(fired)} faults with syncs after them; over {REPAIR_LIMIT} or never: {slow or 'none'}",
            not slow,
        ),
        (
            f"≤ {RESYNC_SHARE_LIMIT:.0%} of syncs re-synced with no fault to blame",
            f"{share:.2%} of {free}",
            share <= RESYNC_SHARE_LIMIT,
        ),
        (
            f"≤ {RETRY_SHARE_LIMIT:.0%} of each cluster's syncs retried with no fault to blame",
            f"at most {retried:.2%} ("
            + ", ".join(
                f"{c.get('retried_without_fault', 0)} of {c['syncs_without_fault']}" for c in clusters
            )
            + ")",
            retried <= RETRY_SHARE_LIMIT,
        ),
        *ledger_rows(ledger, minority, lighter, dropped),
        ("no hang (the global timeout)", "hung" if hung else "finished", not hung),
        ("nothing left running", f"{len(left_running)} processes", not left_running),
    ]
    return [{"target": t, "value": v, "passed": bool(ok)} for t, v, ok in rows]


def ledger_rows(ledger: list[str], minority: list[str], lighter: list[str], dropped: int) -> list[tuple]:
    """Issue 48's and 49's targets: whole chains, the majority's work kept, the heavier fork kept."""
    return [
        (
            "every cluster's ledger chain continuous, ending at its final θ",
            f"{len(ledger)} breaks" + (f": {ledger[0]}" if ledger else ""),
            not ledger,
        ),
        (
            "no cluster took a cut-off cluster's state (the majority's work kept)",
            f"{len(minority)} re-syncs onto it" + (f": {minority[0]}" if minority else ""),
            not minority,
        ),
        (
            "no cluster took a chain with less committed work than its own (the heavier fork kept)",
            f"{len(lighter)} takes"
            + (f": {lighter[0]}" if lighter else "")
            + f"; {dropped} dropped forks recorded",
            not lighter,
        ),
    ]


def retried_counts(clusters: list[dict]) -> str:
    """Each cluster's syncs retried with no fault to blame, of its syncs with none."""
    return ", ".join(f"{c.get('retried_without_fault', 0)} of {c['syncs_without_fault']}" for c in clusters)


def all_syncs(out: Path, clusters: int) -> list[list[dict]]:
    """Every cluster's syncs, from its metrics file."""
    from scripts.chaos.records import read_all

    return [read_all(out / f"cluster{c}.jsonl").syncs for c in range(clusters)]
