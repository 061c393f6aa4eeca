"""Charts as inline SVG text: a page that needs no JS library and no network, and stays small.

A line holds at most about two points per pixel column (:func:`thin`), so a chart's size follows its width,
not the run's length: a 1,000-round run at H = 500 has half a million steps per cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

CLUSTER_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
WIDTH, HEIGHT = 520, 220
LEFT, RIGHT, TOP, BOTTOM = 58, 12, 26, 34


def cluster_color(index: int) -> str:
    return CLUSTER_COLORS[index % len(CLUSTER_COLORS)]


@dataclass
class Series:
    """One line: a cluster's ``points`` (x, y); ``dots`` draws each point (sparse values, e.g. val_loss)."""

    cluster: int
    label: str
    points: list[tuple[float, float]]
    dots: bool = False


def thin(points: list[tuple[float, float]], columns: int) -> list[tuple[float, float]]:
    """At most ``columns`` points: the mean of each run of neighbours (points sorted by x)."""
    if len(points) <= columns:
        return points
    per = len(points) / columns
    out = []
    for i in range(columns):
        chunk = points[int(i * per) : int((i + 1) * per)] or points[int(i * per) : int(i * per) + 1]
        out.append((sum(p[0] for p in chunk) / len(chunk), sum(p[1] for p in chunk) / len(chunk)))
    return out


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round numbers spanning ``low`` … ``high``."""
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-2:
        return f"{value:.2g}"
    return f"{value:.4g}"


def line_chart(title: str, x_label: str, series: list[Series], chart_id: str = "") -> str:
    """An SVG line chart, one line per series in its cluster's colour; a chart with no points says so."""
    points = [p for s in series for p in s.points if math.isfinite(p[1])]
    head = (
        f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
        f'height="{HEIGHT}" role="img"><title>{escape(title)}</title>'
        f'<text class="ct" x="{LEFT}" y="16">{escape(title)}</text>'
    )
    if not points:
        return head + f'<text class="none" x="{WIDTH / 2}" y="{HEIGHT / 2}">not in these metrics</text></svg>'
    x_ticks = nice_ticks(min(p[0] for p in points), max(p[0] for p in points))
    y_ticks = nice_ticks(min(p[1] for p in points), max(p[1] for p in points))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    x0, x1 = min(x0, min(p[0] for p in points)), max(x1, max(p[0] for p in points))
    y0, y1 = min(y0, min(p[1] for p in points)), max(y1, max(p[1] for p in points))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1) * plot_w

    def sy(y: float) -> float:
        return TOP + plot_h - (y - y0) / ((y1 - y0) or 1) * plot_h

    parts = [head, _axes(x_ticks, y_ticks, sx, sy, x_label)]
    for s in series:
        kept = thin([p for p in s.points if math.isfinite(p[1])], plot_w * 2)
        if not kept:
            continue
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in kept)
        color = cluster_color(s.cluster)
        parts.append(
            f'<g class="c{s.cluster}"><polyline fill="none" stroke="{color}" stroke-width="1.3" '
            f'points="{path}">'
            f"<title>{escape(s.label)}</title></polyline>"
        )
        if s.dots:
            parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{color}"/>' for x, y in kept]
        parts.append("</g>")
    return "".join(parts) + "</svg>"


def _axes(x_ticks, y_ticks, sx, sy, x_label: str) -> str:
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    parts = [f'<path class="ax" d="M{LEFT},{TOP}V{bottom}H{right}"/>']
    for x in x_ticks:
        parts.append(
            f'<text class="tk" x="{sx(x):.1f}" y="{bottom + 13}" text-anchor="middle">{_label(x)}</text>'
        )
    for y in y_ticks:
        parts.append(f'<path class="grid" d="M{LEFT},{sy(y):.1f}H{right}"/>')
        parts.append(
            f'<text class="tk" x="{LEFT - 4}" y="{sy(y) + 3:.1f}" text-anchor="end">{_label(y)}</text>'
        )
    parts.append(f'<text class="al" x="{(LEFT + right) / 2}" y="{HEIGHT - 4}">{escape(x_label)}</text>')
    return "".join(parts)
