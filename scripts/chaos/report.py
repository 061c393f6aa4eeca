"""The soak's output: ``summary.json`` (every figure), ``summary.md`` (the tables a person reads, printed
too) and ``report.html`` (``open-diloco report``'s page of the clusters' metrics: the rounds, splits and heals
to look at), in the soak's output directory beside the clusters' logs and metrics and ``events.log``."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.chaos.analysis import galaxy_goodput, galaxy_token_rates


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def cluster_table(clusters: list[dict]) -> list[str]:
    rows = [
        "| cluster | launches | syncs | out of sync | longest run | longest run after faults "
        "| in_sync false (longest after faults) | re-synced "
        "| re-synced w/o fault | sat out (bad Δ) | retries | retried w/o fault | split syncs | stopped "
        "| final outer step | final hash | goodput |",
        "|" + "---|" * 17,
    ]
    for i, c in enumerate(clusters):
        rows.append(
            f"| {i} | {c['launches']} | {c['syncs']} | {c['out_of_sync']} | {c['longest_out_of_sync_run']} "
            f"| {c['longest_out_of_sync_run_after_faults']} "
            f"| {c.get('in_sync_false', '–')} ({c.get('longest_in_sync_false_run_after_faults', '–')}) "
            f"| {c['resynced']} "
            f"| {c['resynced_without_fault']} of {c['syncs_without_fault']} "
            f"({c['resynced_share_without_fault']:.1%}) | {c['sat_out']} ({c['sat_out_bad_pseudo_grad']}) "
            f"| {c['retries']} | {c.get('retried_without_fault', '–')} | {c['split_syncs']} "
            f"| {'YES' if c['stopped'] else 'no'} "
            f"| {_fmt(c['final_outer_step'])} | {_fmt(c['final_param_hash'])} "
            f"| {_percent(c.get('goodput'))} |"
        )
    goodput, rates = galaxy_goodput(clusters), galaxy_token_rates(clusters)
    line = f"Galaxy goodput (tokens committed ÷ computed, every cluster): {_percent(goodput)}"
    if rates is not None:
        line += (
            f"; tokens per second over the syncs' span: {rates[0]:,.0f} computed, {rates[1]:,.0f} committed"
        )
    rows += ["", line + "."]
    return rows


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _by_cluster(fault: dict) -> str:
    """Each cluster's repair as ``c: syncs/seconds`` (``never``: it had syncs after the fault, none good)."""
    parts = []
    for cluster, repair in sorted(fault.get("repair_by_cluster", {}).items()):
        parts.append(f"{cluster}: {repair[0]}/{repair[1]:.0f}s" if repair else f"{cluster}: never")
    return ", ".join(parts) or "–"


def fault_table(faults: list[dict], started: float) -> list[str]:
    rows = [
        "| # | fault | cluster | at outer step | start s | end s | repair (syncs) | repair (s) "
        "| by cluster (syncs/s) | note |",
        "|" + "---|" * 10,
    ]
    for f in faults:
        rel = [None if f[k] is None else f[k] - started for k in ("start", "end")]
        repair = _fmt(f.get("repair_syncs")) if f.get("repaired") or not f["fired"] else "never"
        if f["fired"] and not f.get("syncs_after"):
            repair = "no syncs after"
        where = f"{f['cluster']}{'' if f['shard'] is None else '/' + str(f['shard'])}"
        note = f["note"]
        if f.get("repair_from") is not None:  # another fault was still on at its end
            note = "; ".join(filter(None, [note, f"repair from {f['repair_from'] - started:.1f} s"]))
        rows.append(
            f"| {f['index']} | {f['kind']} | {where} | {f['trigger']} | {_fmt(rel[0])} | {_fmt(rel[1])} "
            f"| {repair} | {_fmt(f.get('repair_seconds'))} | {_by_cluster(f)} | {note} |"
        )
    return rows


def _load(summary: dict) -> str:
    loads = summary["load_average_per_minute"]
    return f"{min(loads):.1f}–{max(loads):.1f} (mean {sum(loads) / len(loads):.1f})" if loads else "unknown"


def markdown(summary: dict) -> str:
    verdict = "PASSED" if summary["passed"] else "FAILED"
    lines = [
        f"# Chaos soak {summary['date']}: {verdict}",
        "",
        f"`{summary['command']}`",
        "",
        f"{summary['setting']}; trainers from `{summary['package_file']}`; "
        f"{summary['seconds']:.0f} s wall clock on {summary['cpus']} CPUs, load average {_load(summary)}.",
        "",
        "## Clusters",
        "",
        *cluster_table(summary["clusters"]),
        "",
        "## Faults",
        "",
        *fault_table(summary["faults"], summary["started"]),
        "",
        "## Acceptance",
        "",
        "| target | value | |",
        "|---|---|---|",
    ]
    lines += [
        f"| {t['target']} | {t['value']} | {'pass' if t['passed'] else 'FAIL'} |"
        for t in summary["acceptance"]
    ]
    lines += ["", "## Notable log lines (numbers as N)", "", "| count | line |", "|---|---|"]
    lines += [f"| {row['count']} | `{row['line'].replace('|', '/')}` |" for row in summary["log_lines"]]
    if summary["left_running"]:
        lines += ["", "## Left running (ended by the soak afterwards)", ""]
        lines += [f"- {p['pid']}: `{p['cmd']}`" for p in summary["left_running"]]
    return "\n".join(lines) + "\n"


def write(out: Path, summary: dict) -> str:
    """Write the three files; returns the markdown."""
    text = markdown(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "summary.md").write_text(text)
    write_page(out, len(summary["clusters"]))
    return text


def write_page(out: Path, clusters: int) -> None:
    """``report.html`` of the clusters' metrics; a page that cannot be made (a metrics file cut by a kill -9)
    is said in one line, and the soak's verdict stands without it."""
    from open_diloco.errors import ConfigError
    from open_diloco.report.page import write_page as write_report_page

    paths = [out / f"cluster{c}.jsonl" for c in range(clusters)]
    try:
        write_report_page(
            [path for path in paths if path.exists()], out / "report.html", name=lambda p: p.name
        )
    except ConfigError as err:
        print(f"no report.html: {err}")
