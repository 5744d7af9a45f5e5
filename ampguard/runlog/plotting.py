"""A run's story in one picture: :func:`plot` (needs matplotlib, the ``ampguard[cli]`` extra).

One function per panel, all drawing from a :class:`_Story` (the run and what every panel needs
of it); :func:`plot` lays the panels out and writes the PNG.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError
from ..records import SKIP_REASONS, StepReport
from .notes import anomaly_strip
from .reading import RankLog, Run, decided_steps, origins

__all__ = ["figure", "plot"]

_REASON_COLORS = {
    "nonfinite_loss": "#d62728",
    "nonfinite_grad": "#ff7f0e",
    "grad_spike": "#9467bd",
    "loss_spike": "#8c564b",
    "rollback": "#e377c2",
}
_OTHER_COLOR = "#7f7f7f"
_ANOMALY_LINE: dict[str, Any] = {"color": "#444444", "lw": 0.9, "ls": (0, (4, 3))}
_TITLE: dict[str, Any] = {"loc": "left", "fontsize": 11, "fontweight": "bold"}
_LEGEND: dict[str, Any] = {"loc": "upper right", "fontsize": 8.5, "framealpha": 0.9}
_LEGEND_ABOVE: dict[str, Any] = {"loc": "lower right", "bbox_to_anchor": (1.0, 1.0), "fontsize": 8.5,
                                 "frameon": False, "borderaxespad": 0.15, "handlelength": 1.6}
"""The legend of a panel with a few entries: above its top right corner, in the title's row, so it
hides no data and no note."""
_DPI = 100
_STRIP_RATIO = 1.0


@dataclasses.dataclass
class _Story:
    """What the panels draw from."""

    run: Run
    cmap: Any
    ranks: list[RankLog] = dataclasses.field(init=False)
    decided: dict[int, StepReport] = dataclasses.field(init=False)
    """One report per step (the decision is the same on every rank)."""
    skipped: list[tuple[int, str]] = dataclasses.field(init=False)
    """(step, reason) of every skipped step, by step."""
    x_max: int = dataclasses.field(init=False)
    """The last step of the run (at least 1)."""

    def __post_init__(self) -> None:
        self.ranks = list(self.run.ranks.values())
        self.decided = decided_steps(self.run)
        self.skipped = sorted((r.step, r.reason or "?") for r in self.decided.values() if r.skipped)
        last_logged = max((s for log in self.ranks for s in log.step), default=0)
        self.x_max = max(last_logged, max((log.steps_seen for log in self.ranks), default=1) - 1, 1)

    def color(self, i: int) -> Any:
        return self.cmap(i % 10)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError(
            "ampguard report --plot needs matplotlib: pip install 'ampguard[cli]'"
        ) from None
    return plt


def plot(run: Run, out_png: str | os.PathLike[str], *, width_px: int = 1600, height_px: int = 1200) -> Path:
    """Write one PNG with aligned panels sharing the step axis (see :func:`figure`).

    Needs matplotlib (the ``ampguard[cli]`` extra); uses the Agg backend, so no display is needed.
    """
    plt = _pyplot()
    fig = figure(run, width_px=width_px, height_px=height_px)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=_DPI)
    plt.close(fig)
    return out


def figure(run: Run, *, width_px: int = 1600, height_px: int = 1200) -> Any:
    """The picture as a matplotlib ``Figure`` (what :func:`plot` saves; close it with
    ``matplotlib.pyplot.close(fig)``): aligned panels sharing the step axis: a strip of anomaly
    notes (when there are anomalies); loss; loss scale per rank (log2); gradient norm (log); when
    the run sampled them (``GuardConfig.indicators_every``), the leading indicators per top-level
    module; non-finite counts per rank; when sampled, the fp16 numerics (zero fraction, headroom);
    when the log holds torchao float8 casts (``StepReport.fp8``), the fp8 panel last. Skipped
    steps are shaded and anomalies drawn as vertical lines across every panel.

    Every anomaly is named in the strip: each note gives the kind, where it was localised and its
    origin ranks; anomalies too close together for notes of their own share one (``steps A-B: 3
    overflow, 1 loss_spike``). The notes stay inside the figure and clear of every legend (the
    panels' legends sit above their panels, outside the data).
    """
    plt = _pyplot()
    story = _Story(run, plt.get_cmap("tab10"))
    numerics = _has_numerics(run)
    indicators = _indicator_log(story) is not None
    fp8 = _fp8_log(story) is not None
    strip = bool(run.anomalies)
    ratios = [*([_STRIP_RATIO] if strip else []), 3, 2.2, 2.2, *([2.6] if indicators else []),
              0.9 + 0.35 * max(len(run.ranks), 1), *([2.2] if numerics else []), *([2.6] if fp8 else [])]
    fig, all_axes = plt.subplots(
        len(ratios), 1, sharex=True,
        figsize=(width_px / _DPI, (height_px + 250 * indicators + 300 * numerics + 320 * fp8) / _DPI),
        dpi=_DPI, gridspec_kw={"height_ratios": ratios, "hspace": 0.3},
    )
    ax_strip, axes = (all_axes[0], all_axes[1:]) if strip else (None, all_axes)
    ax_loss, ax_scale, ax_norm, ax_nf = axes[0], axes[1], axes[2], axes[3 + indicators]
    if numerics:
        _numerics_panel(axes[4 + indicators], story)
    if fp8:
        _fp8_panel(axes[-1], story)
    _mark_skips_and_anomalies(all_axes, story, width_px)
    _loss_panel(ax_loss, story)
    _scale_panel(ax_scale, story)
    _grad_norm_panel(ax_norm, story)
    if indicators:
        _indicators_panel(axes[3], story)
    _nonfinite_panel(ax_nf, story)
    _finish_axes(axes, multi=len(story.ranks) > 1)
    _legend_and_title(fig, story)
    if numerics or fp8:  # the step axis label under the last panel; room for its right axis
        ax_nf.set_xlabel("")
        axes[-1].set_xlabel("step")
    right = 0.94 if indicators else 0.955 if numerics or fp8 else 0.985
    fig.subplots_adjust(left=0.07, right=right, top=0.915, bottom=0.055)
    _fit_left_margin(fig, all_axes)
    if ax_strip is not None:
        anomaly_strip(ax_strip, run.anomalies, dpi=_DPI, title=_TITLE)
    return fig


def _fit_left_margin(fig: Any, axes: Sequence[Any]) -> None:
    """Widen the left margin until every panel's tick labels and axis label are inside the figure
    (the non-finite panel's row labels grow with the counts they hold)."""
    renderer = fig.canvas.get_renderer()
    overhang = max(0.0, *(-ax.get_tightbbox(renderer).x0 for ax in axes))
    if overhang > 0:
        left = fig.subplotpars.left + (overhang + 6) / fig.bbox.width
        fig.subplots_adjust(left=left)


def _mark_skips_and_anomalies(axes: Sequence[Any], story: _Story, width_px: int) -> None:
    """Every panel: skipped steps as bands shaded by reason (at least ~2 px wide, so that a skipped
    step of a long run still shows), anomalies as dashed vertical lines."""
    half = max(0.5, story.x_max / width_px)
    for ax in axes:
        for step, reason in story.skipped:
            ax.axvspan(step - half, step + half, color=_REASON_COLORS.get(reason, _OTHER_COLOR), alpha=0.18, lw=0)
        for a in story.run.anomalies:
            ax.axvline(a.step, alpha=0.8, **_ANOMALY_LINE)


def _loss_panel(ax: Any, story: _Story) -> None:
    """Loss per rank (one "all ranks" line when they agree, as the guard's global values do);
    non-finite losses as red crosses on the top edge; a log axis when it spans > 100x."""
    for i, (label, log, xs, ys) in enumerate(_series(story.ranks, "loss")):
        ax.plot(xs, ys, "-" if log.every_step else "o", color=story.color(i), lw=1.4 if i == 0 else 1.0, ms=3,
                alpha=1.0 if i == 0 else 0.75, label=label)
    reports = [r for log in story.ranks for r in log.reports]
    finite = [r.loss for r in reports if r.loss is not None and math.isfinite(r.loss)]
    bad = sorted({r.step for r in reports if r.nonfinite_loss})
    if bad:
        ax.plot(bad, [1.0] * len(bad), "x", color="#d62728", ms=9, mew=2.2,
                transform=ax.get_xaxis_transform(), clip_on=False, label="non-finite loss")
    if finite and min(finite) > 0 and max(finite) / min(finite) > 100:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.set_title("loss", **_TITLE)


def _scale_panel(ax: Any, story: _Story) -> None:
    """Loss scale per rank, log2 axis."""
    has_scale = False
    for i, log in enumerate(story.ranks):
        pts = [(r.step, r.loss_scale) for r in log.reports if math.isfinite(r.loss_scale) and r.loss_scale > 0]
        if not pts:
            continue
        has_scale = True
        ax.step([x for x, _ in pts], [y for _, y in pts], where="mid", color=story.color(i), lw=2.0 if i == 0 else 1.2,
                ls="-" if i == 0 else (0, (5, 3)), label=f"rank {log.rank}")
    if has_scale:
        ax.set_yscale("log", base=2)
    ax.set_ylabel("loss scale (log2)")
    ax.set_title("loss scale per rank", **_TITLE)


def _grad_norm_panel(ax: Any, story: _Story) -> None:
    """Gradient norm, log axis; non-finite norms as orange triangles on the top edge."""
    for i, (label, log, xs, ys) in enumerate(_series(story.ranks, "grad_norm", positive=True)):
        ax.plot(xs, ys, "-" if log.every_step else "o", color=story.color(i), lw=1.2, ms=3,
                alpha=1.0 if i == 0 else 0.75, label=label)
    reports = [r for log in story.ranks for r in log.reports]
    bad = sorted({r.step for r in reports if not math.isfinite(r.grad_norm)})
    if bad:
        ax.plot(bad, [1.0] * len(bad), "^", color="#ff7f0e", ms=8, mec="black", mew=0.6,
                transform=ax.get_xaxis_transform(), clip_on=False, label="non-finite grad norm")
    if any(r.grad_norm > 0 and math.isfinite(r.grad_norm) for r in reports):
        ax.set_yscale("log")
    ax.set_ylabel("grad norm (L2, unscaled)")
    ax.set_title("gradient norm", **_TITLE)


def _indicator_log(story: _Story) -> RankLog | None:
    """The lowest rank whose log holds sampled leading indicators (they are rank-local), or None."""
    return next((log for log in story.ranks if any(r.module_grad_norms for r in log.reports)), None)


def _indicators_panel(ax: Any, story: _Story) -> None:
    """The leading indicators of one rank, per top-level module: gradient norm (solid, left log
    axis) and update ratio ||dw||/||w|| (dashed, right log axis), one colour per module. Only
    positive finite values are drawn (0: no gradient, or a skipped step)."""
    log = _indicator_log(story)
    assert log is not None  # internal: plot() asks first
    sampled = [r for r in log.reports if r.module_grad_norms]
    modules = list(dict.fromkeys(m for r in sampled for m, _ in r.module_grad_norms or ()))
    twin = ax.twinx()
    for i, module in enumerate(modules):
        for target, field, style in ((ax, "module_grad_norms", "-"), (twin, "module_update_ratios", "--")):
            pts = [(r.step, dict(getattr(r, field) or ()).get(module, math.nan)) for r in sampled]
            pts = [(x, y) for x, y in pts if math.isfinite(y) and y > 0]
            if pts:
                target.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", ms=2.5, lw=1.2,
                            color=story.color(i), label=module if target is ax else None)
    for target, label in ((ax, "grad norm per module (solid)"), (twin, "update ratio ||dw||/||w|| (dashed)")):
        if target.get_lines():
            target.set_yscale("log")
        target.set_ylabel(label, fontsize=9)
        target.tick_params(labelsize=9)
    where = f" (rank {log.rank})" if len(story.ranks) > 1 else ""
    ax.set_title(f"leading indicators per top-level module{where}", **_TITLE)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title="module", ncol=min(len(modules), 6), **_LEGEND)


def _nonfinite_panel(ax: Any, story: _Story) -> None:
    """Where non-finite values came from: one row per rank, a marker per step (x: the loss, triangle:
    gradients, sized by the non-finite tensor count), the totals in the row label."""
    run, decided, world = story.run, story.decided.values(), story.run.world_size
    origin_ranks = sorted(set(run.ranks) | {o for r in decided for o in r.nonfinite_ranks})
    labels = []
    for i, rank in enumerate(origin_ranks):
        came_from = [r for r in decided if rank in origins(r, rank, world)]
        loss_x = [r.step for r in came_from if r.nonfinite_loss]
        grad = [(r.step, r.nonfinite_grads) for r in came_from if r.nonfinite_grads > 0]
        if loss_x:
            ax.plot([x - 0.18 for x in loss_x], [i] * len(loss_x), "x", color="#d62728", ms=10, mew=2.4,
                    label="non-finite loss")
        if grad:
            gx, gn = zip(*grad)
            ax.scatter([x + 0.18 for x in gx], [i] * len(gx), s=[40 + 14 * min(n, 20) for n in gn], marker="^",
                       color="#ff7f0e", edgecolors="black", linewidths=0.6, zorder=3, label="non-finite gradients")
        labels.append(f"rank {rank}\n{len(loss_x)} loss / {len(grad)} grad")
    ax.set_yticks(range(len(origin_ranks)), labels, fontsize=8.5)
    ax.set_ylim(-0.7, len(origin_ranks) - 0.3)
    ax.invert_yaxis()
    ax.set_title("non-finite values, by the rank they came from (steps)", **_TITLE)
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles))  # one entry per kind, whatever the number of ranks
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), ncol=len(uniq), **_LEGEND_ABOVE)
    ax.set_xlabel("step")
    ax.set_xlim(-0.5, story.x_max + 0.5)


def _has_numerics(run: Run) -> bool:
    """Whether any logged step was sampled by ``GuardConfig.numerics_every`` (then the last panel)."""
    return any(r.grad_zero_fraction is not None for log in run.ranks.values() for r in log.reports)


def _numerics_panel(ax: Any, story: _Story) -> None:
    """fp16 numerics of the sampled steps, per rank (rank-local values): the fraction of gradient
    elements exactly zero (left axis; solid: every gradient, dotted: per param group) and the headroom
    log2(65504 / max|scaled grad|) (right axis, dashed; fp16 only, finite values)."""
    right = ax.twinx()
    for i, log in enumerate(story.ranks):
        sampled = [r for r in log.reports if r.grad_zero_fraction is not None]
        who = f"rank {log.rank}" if len(story.ranks) > 1 else "all params"
        ax.plot([r.step for r in sampled], [r.grad_zero_fraction for r in sampled], "-o", ms=2.5, lw=1.0,
                color=story.color(i), label=f"zero fraction, {who}", zorder=3)
        groups = max((len(r.group_zero_fractions or ()) for r in sampled), default=0)
        for g in range(groups if groups > 1 else 0):
            pts = [(r.step, r.group_zero_fractions[g]) for r in sampled
                   if r.group_zero_fractions is not None and len(r.group_zero_fractions) > g
                   and math.isfinite(r.group_zero_fractions[g])]
            ax.plot([x for x, _ in pts], [y for _, y in pts], ":", lw=2.4, color=story.color(i + 1 + g),
                    label=f"zero fraction, group {g}" + (f", rank {log.rank}" if len(story.ranks) > 1 else ""))
        pts = [(r.step, r.headroom_log2) for r in sampled if r.headroom_log2 is not None
               and math.isfinite(r.headroom_log2)]
        if pts:
            right.plot([x for x, _ in pts], [y for _, y in pts], "--", lw=1.3, color="#555555" if i == 0 else
                       story.color(i), label="headroom (log2)" + (f", rank {log.rank}" if len(story.ranks) > 1 else ""))
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("zero fraction")
    right.set_ylabel("headroom (log2)")
    right.axhline(0, color="#d62728", lw=0.8, alpha=0.6)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    if handles:
        ax.legend(handles=handles, **_LEGEND)
    ax.set_title("fp16 numerics (sampled steps): gradient zero fraction, loss-scale headroom", **_TITLE)


_ROLE_COLORS = {"input": "#1f77b4", "weight": "#2ca02c", "grad_output": "#d62728"}


def _fp8_log(story: _Story) -> RankLog | None:
    """The lowest rank whose log holds fp8 casts (they are rank-local), or None."""
    return next((log for log in story.ranks if any(r.fp8 for r in log.reports)), None)


def _fp8_panel(ax: Any, story: _Story) -> None:
    """The torchao float8 casts of one rank, per role (one colour each): the amax of the worst module
    (the largest finite amax over the step's casts of that role; solid, left log axis; a step's log
    line holds every cast, or on a healthy unsampled step the bounded fold whose ``_other`` keeps the
    largest), the underflow ratio of the worst module on sampled steps (dashed, right axis), and the
    steps with a non-finite cast of that role (NaN/inf amax, NaN/0 scale) marked on the top edge."""
    log = _fp8_log(story)
    assert log is not None  # internal: figure() asks first
    reports = [r for r in log.reports if r.fp8]
    roles = list(dict.fromkeys(c.role for r in reports for c in r.fp8 or ()))
    colors = {role: _ROLE_COLORS.get(role, story.color(3 + i)) for i, role in enumerate(roles)}
    right = ax.twinx()
    worst_under = 0.0
    drawn: list[str] = []
    for i, (role, color) in enumerate(colors.items()):
        amax, under, bad = [], [], []
        for r in reports:
            casts = [c for c in r.fp8 or () if c.role == role]
            if not casts:
                continue
            finite = [c.amax for c in casts if c.finite and c.amax > 0]
            if finite:
                amax.append((r.step, max(finite)))
            sampled = [c.underflow for c in casts if c.underflow is not None and math.isfinite(c.underflow)]
            if sampled:
                under.append((r.step, max(sampled)))
            if not all(c.finite for c in casts):
                bad.append(r.step)
        if amax:
            ax.plot([x for x, _ in amax], [y for _, y in amax], "-", lw=1.4, color=color, label=f"{role} amax")
        if under:
            worst_under = max(worst_under, *(y for _, y in under))
            right.plot([x for x, _ in under], [y for _, y in under], "--o", lw=1.1, ms=3, color=color,
                       label=f"{role} underflow")
        if bad:  # on the top edge, one row per role so that two roles' marks at one step both show
            ax.plot(bad, [0.97 - 0.09 * i] * len(bad), "X", color=color, mec="black", mew=0.6, ms=9, zorder=4,
                    transform=ax.get_xaxis_transform(), clip_on=False, label=f"{role} non-finite cast")
        if amax or under or bad:
            drawn.append(role)
    if any(line.get_label().endswith(" amax") for line in ax.get_lines()):
        ax.set_yscale("log")
    from matplotlib.lines import Line2D
    from matplotlib.ticker import PercentFormatter

    right.set_ylim(0, max(0.01, 1.1 * worst_under))
    right.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylabel("amax (log)", fontsize=9)
    right.set_ylabel("underflow ratio", fontsize=9)
    right.tick_params(labelsize=9)
    where = f" (rank {log.rank})" if len(story.ranks) > 1 else ""
    ax.set_title(f"fp8 casts{where}, the worst module per role", **_TITLE)
    # the legend: a colour per role, a style per quantity (the lines keep their own labels)
    keys = [Line2D([], [], color=colors[role], lw=3, label=role) for role in drawn]
    keys += [Line2D([], [], color="#444444", lw=1.4, label="amax"),
             Line2D([], [], color="#444444", ls="--", marker="o", ms=3, lw=1.1, label="underflow (sampled steps)"),
             Line2D([], [], color="#444444", ls="", marker="X", mec="black", ms=8, label="non-finite cast")]
    ax.legend(handles=keys, ncol=len(keys), **_LEGEND_ABOVE)


def _finish_axes(axes: Sequence[Any], multi: bool) -> None:
    """Plain numbers on log axes, grids, and the legends of the first three panels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax_loss, ax_scale, ax_norm = axes[:3]
    for ax in (ax_loss, ax_norm):
        if ax.get_yscale() == "log":  # plain numbers (2, 3, 0.5), not 2x10^0
            lo, hi = ax.get_ylim()
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            if hi / max(lo, 1e-300) < 100:  # label the 2s and 5s between decades, not every minor tick
                ax.yaxis.set_minor_formatter(FuncFormatter(
                    lambda v, _: f"{v:g}" if v > 0 and f"{v:e}"[0] in "25" else ""))
            else:
                ax.yaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=9)
    for ax in (ax_loss, ax_scale, ax_norm):
        handles = ax.get_legend_handles_labels()[0]
        if handles and (multi or ax is ax_loss or ax is ax_norm):
            ax.legend(ncol=len(handles), **_LEGEND_ABOVE)


def _legend_and_title(fig: Any, story: _Story) -> None:
    """One legend, at the top, for what the shading and lines mean; the run in one line above it."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    run = story.run
    reasons = sorted({reason for _, reason in story.skipped}, key=lambda k: (k not in SKIP_REASONS, k))
    keys: list[Any] = [Patch(color=_REASON_COLORS.get(k, _OTHER_COLOR), alpha=0.35, label=f"skipped: {k}")
                       for k in reasons]
    if run.anomalies:
        keys.append(Line2D([], [], label="anomaly", **_ANOMALY_LINE))
    if keys:
        fig.legend(handles=keys, loc="upper right", ncol=len(keys), fontsize=9, frameon=False,
                   bbox_to_anchor=(0.985, 0.955))
    info = run.info
    state = "" if run.closed else "  (no close record: in progress or killed)"
    fig.suptitle(
        f"ampguard run {run.run_id}: {info.get('precision', '?')}, {info.get('backend', '?')}, "
        f"{run.world_size} rank(s), {story.x_max + 1} steps, {len(story.skipped)} skipped, "
        f"{len(run.anomalies)} anomalies{state}",
        x=0.06, y=0.985, ha="left", fontsize=13, fontweight="bold",
    )


_Series = tuple[str, RankLog, list[int], list[float]]


def _series(ranks: Sequence[RankLog], attr: str, positive: bool = False) -> list[_Series]:
    """(label, log, steps, values) per rank, finite values only; one "all ranks" series when they agree."""
    out = []
    for log in ranks:
        pts = [(r.step, float(v)) for r in log.reports if (v := getattr(r, attr)) is not None]  # None: unknown
        pts = [(x, y) for x, y in pts if math.isfinite(y) and (y > 0 or not positive)]
        out.append((f"rank {log.rank}", log, [x for x, _ in pts], [y for _, y in pts]))
    if len(out) > 1 and all(o[2:] == out[0][2:] for o in out[1:]):
        return [("all ranks", out[0][1], out[0][2], out[0][3])]
    return out
