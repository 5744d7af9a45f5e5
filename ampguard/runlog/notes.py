"""The anomaly strip of the run's picture: one note per anomaly (its kind, where it was localised, its
origin ranks), or one per group of close ones, laid out in lanes so that no note overlaps another."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from .reading import LoggedAnomaly

__all__ = ["anomaly_strip"]

_LANES = 4
_NOTE_FONT = 8.5


def _note(a: LoggedAnomaly) -> str:
    """One anomaly's note: its kind, where it was localised, its origin ranks."""
    if a.module:
        where = f": module {a.module}" + (f" ({a.phase})" if a.phase else "")
    else:
        where = f": {a.params[0]}" if a.params else ""
    rk = f", rank {','.join(map(str, a.ranks))}" if a.ranks else ""
    return f"{a.kind}{where}{rk}"


def _group_note(group: Sequence[LoggedAnomaly]) -> str:
    """The note of anomalies that share one: the steps, their count and those of the two most
    frequent kinds."""
    if len(group) == 1:
        return _note(group[0])
    first, last = group[0].step, group[-1].step
    steps = f"step {first}" if first == last else f"steps {first}\u2013{last}"
    kinds = sorted(Counter(str(a.kind) for a in group).items(), key=lambda kv: (-kv[1], kv[0]))
    if len(kinds) == 1:
        return f"{steps}: {kinds[0][1]} {kinds[0][0]}"
    return (f"{steps}: {len(group)} (" + ", ".join(f"{n} {kind}" for kind, n in kinds[:2])
            + (", \u2026)" if len(kinds) > 2 else ")"))


@dataclasses.dataclass
class _Placed:
    """A note placed in a lane of the strip (pixel coordinates along the step axis)."""

    group: list[LoggedAnomaly]
    lane: int
    left: float
    right: float


def _layout_notes(anomalies: Sequence[LoggedAnomaly], x_px: Callable[[int], float], width_of: Callable[[str], float],
                  lo: float, hi: float, lanes: int) -> list[_Placed]:
    """Place one note per group of anomalies in ``lanes`` rows between ``lo`` and ``hi`` pixels,
    none overlapping another. Groups start as one per step; while some note finds no room (see
    :func:`_place`), the two groups closest together (in pixels) join, so notes are shared where the
    anomalies crowd, and the notes keep one grain across the run. One group of all always fits."""
    groups: list[list[LoggedAnomaly]] = []
    for a in anomalies:
        if groups and groups[-1][0].step == a.step:
            groups[-1].append(a)
        else:
            groups.append([a])
    widths: dict[str, float] = {}

    def width(group: list[LoggedAnomaly]) -> float:
        text = _group_note(group)
        if text not in widths:
            widths[text] = width_of(text)
        return widths[text]

    while True:
        placed = _place(groups, x_px, width, lo, hi, lanes)
        if placed is not None:
            return placed
        gaps = [x_px(b[0].step) - x_px(a[-1].step) for a, b in itertools.pairwise(groups)]
        i = gaps.index(min(gaps))  # the two closest groups share a note from now on
        groups[i:i + 2] = [groups[i] + groups[i + 1]]


def _place(groups: Sequence[list[LoggedAnomaly]], x_px: Callable[[int], float],
           width: Callable[[list[LoggedAnomaly]], float], lo: float, hi: float, lanes: int) -> list[_Placed] | None:
    """Each group's note in the first lane with room, left to right: a note starts just right of its
    group's first line, or, where it would run past ``hi``, ends just left of its last line. None
    when a note finds no room."""
    gap = 6.0
    ends = [-math.inf] * lanes
    placed = []
    for group in groups:
        w = min(width(group), hi - lo)  # a note wider than the strip gets the strip (and a lane of its own)
        left = x_px(group[0].step) + 3
        if left + w > hi:
            left = max(lo, min(x_px(group[-1].step) - 3, hi) - w)
        lane = next((k for k in range(lanes) if left >= ends[k] + gap), None)
        if lane is None:
            if len(groups) > 1:
                return None
            lane = 0
        ends[lane] = left + w
        placed.append(_Placed(group, lane, left, left + w))
    return placed


def anomaly_strip(ax: Any, anomalies: Sequence[LoggedAnomaly], *, dpi: float, title: dict[str, Any]) -> None:
    """The strip above the panels: one note per anomaly, or per group of close ones (see
    :func:`_layout_notes`), each with a bar spanning the steps it covers. Call it last: it places
    the notes in pixels, from the final layout (``dpi``: the figure's; ``title``: the panels' title
    style)."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    from matplotlib.font_manager import FontProperties

    font = FontProperties(size=_NOTE_FONT)
    pad = 2 * 0.2 * _NOTE_FONT * dpi / 72  # the round box's padding, both sides

    def width_of(text: str) -> float:
        return float(renderer.get_text_width_height_descent(text, font, ismath=False)[0]) + pad + 2

    to_px = ax.transData.transform
    box = ax.get_window_extent(renderer)
    placed = _layout_notes(anomalies, lambda step: float(to_px((step, 0))[0]), width_of,
                           box.x0 + 2, box.x1 - 2, _LANES)
    to_data = ax.transData.inverted().transform
    for p in placed:
        y = _LANES - p.lane - 0.5
        first, last = p.group[0].step, p.group[-1].step
        if last > first:
            ax.plot([first, last], [y - 0.42, y - 0.42], "-", color="#444444", lw=1.6, solid_capstyle="butt")
        ax.annotate(_group_note(p.group), xy=(float(to_data((p.left, 0))[0]), y), ha="left", va="center",
                    fontsize=_NOTE_FONT, color="#222222", annotation_clip=False, gid=f"anomaly-note:{len(p.group)}",
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "#999999", "alpha": 0.9, "lw": 0.5})
    ax.set_ylim(0, _LANES)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="x", length=0)
    shared = len(placed) < len(anomalies)
    ax.set_title(f"anomalies ({len(anomalies)})" + ("; close ones share a note" if shared else ""),
                 **title)
