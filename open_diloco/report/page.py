"""The report's HTML page: summary, splits, round timeline, clusters, loss and per-round charts, all inline.

One file, no network: styles and the few lines of script (click a cluster to hide its lines) are in the page,
charts are SVG text (:mod:`~open_diloco.report.svg`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from html import escape
from pathlib import Path
from statistics import fmean

from open_diloco.report.runs import ClusterMetrics, read_run
from open_diloco.report.story import Story, tell
from open_diloco.report.svg import Series, cluster_color, line_chart
from open_diloco.report.timeline import timeline

ROUND_CHARTS = (
    ("allreduce_seconds", "sync seconds (all-reduce, matchmaking included)", 1.0),
    ("matchmaking_seconds", "matchmaking seconds", 1.0),
    ("bytes_sent", "MB sent (rank 0)", 1e-6),
    ("compute_utilization", "busy share since the previous sync", 1.0),
    ("goodput", "goodput", 1.0),
)
"""Per-round charts: metrics key, title, scale. A key no record carries shows no chart (``goodput``: where a
trainer logs it)."""

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:20px auto;max-width:1120px;color:#222;padding:0 12px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #ddd}
.sub{color:#666;font-size:12px}ul.summary li{margin:2px 0}
table{border-collapse:collapse;font-size:13px}
td,th{padding:3px 9px;border-bottom:1px solid #eee;text-align:right}
th:first-child,td:first-child{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:8px}.chart{border:1px solid #eee;background:#fff}
.ct{font-size:12px;font-weight:600}
.tk{font-size:10px;fill:#555}.al{font-size:10px;fill:#555;text-anchor:middle}
.ax{stroke:#888;fill:none}.grid{stroke:#eee}.none{fill:#999;font-size:12px;text-anchor:middle}
.o-applied{fill:#43a047}.o-adopted{fill:#1e88e5}.o-resynced{fill:#8e24aa}.o-sat_out{fill:#fbc02d}.o-held{fill:#90a4ae}
.o-absent{fill:#f4f4f4;stroke:#bbb;stroke-dasharray:2 1}.oos{fill-opacity:.55;stroke:#e65100;stroke-width:1}
.hatch{fill:url(#hatch);pointer-events:none}.retry{fill:#fff;stroke:#000;stroke-width:.6;pointer-events:none}
.legend .key{margin-right:14px;white-space:nowrap;font-size:12px}.legend svg{vertical-align:-2px}
.who{cursor:pointer;user-select:none;margin-right:12px}.who i{display:inline-block;width:18px;height:3px;
vertical-align:4px;margin-right:4px}.who.off{opacity:.35}.timeline-box{overflow-x:auto}
"""

SCRIPT = """
document.querySelectorAll('.who').forEach(function (chip) {
  chip.addEventListener('click', function () {
    var off = chip.classList.toggle('off');
    document.querySelectorAll('.charts g.' + chip.dataset.c).forEach(function (g) {
      g.style.display = off ? 'none' : '';
    });
  });
});
"""


def write_page(inputs: list[Path], target: Path, name: Callable[[Path], str] = str) -> tuple[Story, int]:
    """Read the run of ``inputs`` (a one-line ConfigError for what is not one whole run), judge it and write
    its page to ``target``, each metrics file named by ``name``; returns the story and the page's bytes."""
    clusters = read_run(inputs)
    story = tell(clusters)
    html = render(story, [name(cluster.path) for cluster in clusters])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(html, encoding="utf-8")
    return story, len(html.encode())


def render(story: Story, sources: list[str]) -> str:
    """The whole page for ``story``; ``sources``: the metrics files it was read from, named at the bottom."""
    run_id = next((c.run_id for c in story.clusters if c.run_id), None) or "(run id not recorded)"
    body = [
        f"<h1>open-diloco report: {escape(run_id)}</h1>",
        f'<p class="sub">from {len(sources)} metrics file(s), started {_clock(story.started)}; generated '
        f"{_clock(time.time())}</p>",
        '<ul class="summary">' + "".join(f"<li>{escape(line)}</li>" for line in story.summary) + "</ul>",
        "<h2>Splits and heals</h2>",
        splits_table(story),
        "<h2>Rounds</h2>",
        '<div class="timeline-box">' + timeline(story) + "</div>",
        "<h2>Clusters</h2>",
        clusters_table(story.clusters),
        "<h2>Loss</h2>",
        '<p class="sub">Each cluster evaluates its own model: while the galaxy is split the curves are of '
        "different models, after a round together of one. Click a cluster to hide its lines.</p>",
        who(story.clusters),
        '<div class="charts">' + "".join(loss_charts(story)) + "</div>",
        "<h2>Per round</h2>",
        who(story.clusters),
        '<div class="charts">' + "".join(round_charts(story.clusters)) + "</div>",
        '<p class="sub">Sources: ' + ", ".join(escape(s) for s in sources) + "</p>",
    ]
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>open-diloco report: {escape(run_id)}</title><style>{STYLE}</style></head><body>"
        + "".join(body)
        + f"<script>{SCRIPT}</script></body></html>\n"
    )


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def who(clusters: list[ClusterMetrics]) -> str:
    """The cluster chips above a row of charts (their colours, click to hide)."""
    chips = [
        f'<span class="who" data-c="c{i}"><i style="background:{cluster_color(i)}"></i>'
        f"{escape(c.label)}</span>"
        for i, c in enumerate(clusters)
    ]
    return "<p>" + "".join(chips) + "</p>"


def splits_table(story: Story) -> str:
    """One row per split: its rounds, who was off, how long it lasted and how long the heal took."""
    if not story.splits:
        return "<p>None: every round was whole.</p>"
    labels = [c.label for c in story.clusters]
    rows = [
        "<tr><th>rounds</th><th>began</th><th>on another state</th><th>absent, re-synced or sat out</th>"
        "<th>rounds</th><th>seconds</th><th>healed at round</th>"
        "<th>heal seconds (all alive again → whole)</th></tr>"
    ]
    for s in story.splits:
        began = _clock(s.began) if s.began is not None else "–"
        rows.append(
            f"<tr><td>{s.first}–{s.last}</td><td>{began}</td>"
            f"<td>{escape(', '.join(labels[i] for i in s.apart) or '–')}</td>"
            f"<td>{escape(', '.join(labels[i] for i in s.missed) or '–')}</td>"
            f"<td>{s.rounds}</td><td>{_num(s.seconds, '.1f')}</td>"
            f"<td>{s.healed_round if s.healed_round is not None else 'not healed'}</td>"
            f"<td>{_num(s.heal_seconds, '.1f')}</td></tr>"
        )
    return "<table>" + "".join(rows) + "</table>"


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return fmean(values) if values else None


def _last(records: list[dict], key: str) -> float | None:
    return next((r[key] for r in reversed(records) if isinstance(r.get(key), (int, float))), None)


def clusters_table(clusters: list[ClusterMetrics]) -> str:
    """Per cluster: launches, steps, rounds, busy share, throughput, bytes, goodput (its last sync's: the
    share of its tokens the galaxy committed, ``outer/goodput.py``), and where its loss ended."""
    rows = [
        "<tr><th>cluster</th><th>launches</th><th>last step</th><th>rounds</th><th>busy share (mean)</th>"
        "<th>tokens/s (mean)</th><th>MB sent</th><th>goodput</th><th>last loss</th>"
        "<th>last val_loss</th></tr>"
    ]
    for i, c in enumerate(clusters):
        busy = _mean(c.syncs, "compute_utilization")
        sent = sum(r.get("bytes_sent") or 0 for r in c.syncs)
        rows.append(
            f'<tr><td><span style="color:{cluster_color(i)}">■</span> {escape(c.label)}</td>'
            f"<td>{c.launches}</td>"
            f"<td>{c.steps[-1]['step']}</td><td>{len(c.syncs)}</td>"
            f"<td>{'–' if busy is None else f'{busy:.0%}'}</td>"
            f"<td>{_num(_mean(c.steps, 'tokens_per_second'), '.0f')}</td>"
            f"<td>{sent / 1e6:.1f}</td><td>{_num(_last(c.syncs, 'goodput'), '.1%')}</td>"
            f"<td>{_num(_last(c.steps, 'loss'), '.3f')}</td>"
            f"<td>{_num(_last(c.steps, 'val_loss'), '.3f')}</td></tr>"
        )
    return "<table>" + "".join(rows) + "</table>"


def loss_charts(story: Story) -> list[str]:
    """loss and val_loss, each against the inner step and against wall time since the run's start."""
    span = max(c.span[1] for c in story.clusters) - story.started
    unit, per = ("hours", 3600.0) if span > 2 * 3600 else ("minutes", 60.0)
    charts = []
    for key, dots in (("loss", False), ("val_loss", True)):
        by_step, by_time = [], []
        for i, c in enumerate(story.clusters):
            rows = [r for r in c.steps if isinstance(r.get(key), (int, float)) and r.get("trained", True)]
            if key == "val_loss":
                rows = [r for r in c.steps if isinstance(r.get(key), (int, float))]
            by_step.append(Series(i, f"{c.label} {key}", [(r["step"], r[key]) for r in rows], dots))
            timed = [(((r["time"] - story.started) / per), r[key]) for r in rows if "time" in r]
            by_time.append(Series(i, f"{c.label} {key}", timed, dots))
        charts.append(line_chart(f"{key} by step", "inner step", by_step, chart_id=f"{key}-step"))
        charts.append(
            line_chart(f"{key} by wall time", f"{unit} since start", by_time, chart_id=f"{key}-time")
        )
    return charts


def round_charts(clusters: list[ClusterMetrics]) -> list[str]:
    """Sync seconds, matchmaking, bytes and busy share per round (and what else the metrics carry)."""
    charts = []
    for key, title, scale in ROUND_CHARTS:
        series = [
            Series(
                i,
                f"{c.label} {key}",
                [(r["outer_step"], r[key] * scale) for r in c.syncs if isinstance(r.get(key), (int, float))],
            )
            for i, c in enumerate(clusters)
        ]
        if any(s.points for s in series) or key != "goodput":
            charts.append(line_chart(title, "round", series, chart_id=key))
    return charts
