"""The round timeline: rounds across, clusters down, each cell a cluster's outcome of a round, as SVG.

Colour is the outcome; a cell on another state than the round's main one (a partition's far side, a fork) is
hatched, one out of sync is outlined, and a retried round carries a dot. Each cell keeps what it shows in
``data-*`` attributes (``data-cluster``, ``data-round``, ``data-outcome``, ``data-galaxy``: ``with``,
``apart`` or ``absent``) so a test, or a person with the inspector, reads the DOM rather than pixels. Long
runs wrap into strips of :data:`ROUNDS_PER_STRIP` rounds.
"""

from __future__ import annotations

from html import escape

from open_diloco.report.story import Cell, Story

ROUNDS_PER_STRIP = 100
CELL_W, CELL_H, LABEL_W, STRIP_GAP = 7, 14, 74, 22
STRIP_WIDTH = 840
"""Pixels a strip's cells fill at most: a short run gets wider cells, down to :data:`CELL_W`."""
OUTCOME_TEXT = {
    "applied": "applied",
    "adopted": "adopted",
    "resynced": "re-synced",
    "sat_out": "sat out",
    "held": "held (no quorum)",
    "absent": "absent",
}
LEGEND = (
    ("applied", "applied (in sync)"),
    ("applied oos", "applied, out of sync"),
    ("applied apart", "applied apart (other state)"),
    ("adopted", "adopted"),
    ("resynced", "re-synced"),
    ("sat_out", "sat out"),
    ("held", "held (no quorum)"),
    ("absent", "absent"),
)


def galaxy_place(cell: Cell) -> str:
    """Whether the cluster was in the galaxy's round: ``with`` it, ``apart`` (on another state), or
    ``absent``."""
    if cell.outcome == "absent":
        return "absent"
    return "apart" if cell.apart else "with"


def _tooltip(cell: Cell, label: str) -> str:
    parts = [f"{label}, round {cell.round}: {OUTCOME_TEXT[cell.outcome]}"]
    if cell.apart:
        parts.append("apart: another state than the round's main one")
    if cell.in_sync is False:
        parts.append("out of sync")
    if cell.attempt:
        parts.append(f"attempt {cell.attempt}")
    if cell.peers is not None:
        parts.append(f"{cell.peers} of {cell.alive if cell.alive is not None else '?'} alive in the average")
    if cell.state_source is not None:
        parts.append(f"state from cluster {cell.state_source}")
    if cell.param_hash:
        parts.append(f"θ {cell.param_hash}")
    return "; ".join(parts)


def _cell(cell: Cell, label: str, x: float, y: float, w: int) -> str:
    classes = [f"o-{cell.outcome}"]
    if cell.in_sync is False and cell.outcome in ("applied", "adopted"):
        classes.append("oos")
    place = galaxy_place(cell)
    text = f"<title>{escape(_tooltip(cell, label))}</title>"
    out = (
        f'<rect class="{" ".join(classes)}" x="{x}" y="{y}" width="{w - 1}" height="{CELL_H - 2}" '
        f'data-cluster="{cell.cluster}" data-round="{cell.round}" data-outcome="{cell.outcome}" '
        f'data-galaxy="{place}" data-attempt="{cell.attempt}">{text}</rect>'
    )
    if cell.apart:
        out += f'<rect class="hatch" x="{x}" y="{y}" width="{w - 1}" height="{CELL_H - 2}"/>'
    if cell.attempt:
        out += f'<circle class="retry" cx="{x + (w - 1) / 2}" cy="{y + CELL_H / 2 - 1}" r="1.6"/>'
    return out


def timeline(story: Story) -> str:
    """The timeline's SVG (one strip per :data:`ROUNDS_PER_STRIP` rounds) and its legend."""
    if not story.rounds:
        return '<p class="none">No cluster recorded a round.</p>'
    first, last = story.rounds[0], story.rounds[-1]
    starts = list(range(first, last + 1, ROUNDS_PER_STRIP))
    strip_h = len(story.clusters) * CELL_H + STRIP_GAP
    per_strip = min(ROUNDS_PER_STRIP, last - first + 1)
    w = max(CELL_W, min(3 * CELL_W, STRIP_WIDTH // per_strip))
    width = LABEL_W + per_strip * w + 30
    height = len(starts) * strip_h
    parts = [
        f'<svg class="timeline" id="timeline" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}">',
        '<defs><pattern id="hatch" width="4" height="4" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)">'
        '<path d="M0,0V4" stroke="#000" stroke-opacity=".45" stroke-width="1.6"/>'
        "</pattern></defs>",
    ]
    labels = [c.label for c in story.clusters]
    for strip, start in enumerate(starts):
        top = strip * strip_h
        end = min(start + ROUNDS_PER_STRIP - 1, last)
        parts.append(f'<text class="tk" x="{LABEL_W}" y="{top + 10}">round {start}</text>')
        parts.append(f'<text class="tk" x="{LABEL_W + (end - start) * w}" y="{top + 10}">{end}</text>')
        for index, label in enumerate(labels):
            y = top + 14 + index * CELL_H
            parts.append(f'<text class="tk c{index}l" x="{LABEL_W - 6}" y="{y + 10}" text-anchor="end">')
            parts.append(f"{escape(label)}</text>")
            for r in range(start, end + 1):
                cell = story.cells.get((index, r))
                if cell is not None:
                    parts.append(_cell(cell, label, LABEL_W + (r - start) * w, y, w))
    parts.append("</svg>")
    return "".join(parts) + legend()


def legend() -> str:
    """What the colours, hatching and dots mean."""
    items = []
    for classes, text in LEGEND:
        outcome, *extra = classes.split()
        swatch = f'<rect class="o-{outcome}{" oos" if "oos" in extra else ""}" width="12" height="12"/>'
        if "apart" in extra:
            swatch = f'<rect class="o-{outcome} oos" width="12" height="12"/>'
            swatch += '<rect class="hatch" width="12" height="12"/>'
        items.append(f'<span class="key"><svg width="12" height="12">{swatch}</svg> {escape(text)}</span>')
    dot = '<svg width="12" height="12"><rect class="o-applied" width="12" height="12"/>'
    dot += '<circle class="retry" cx="6" cy="6" r="2"/></svg>'
    items.append(f'<span class="key">{dot} retried (attempt ≥ 1)</span>')
    return f'<p class="legend">{"".join(items)}</p>'
