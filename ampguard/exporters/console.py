"""ConsoleExporter: the run, live, on the terminal (rich), from rank 0.

On a terminal, one table redrawn in place (``rich.live.Live``): the step, loss, loss scale,
gradient norm, skipped steps by reason, steps per second (and the time left, given
``total_steps``), then the last anomalies with their ranks, module, phase and cause. Redraws are
rate-limited (at most one per ``refresh_s``, plus one per step with an anomaly), so the cost on the
training thread is a few attribute updates per step. Elsewhere (a log file, a pipe, ``plain=True``)
it prints plain lines instead: every ``every`` steps, each skipped step and each anomaly.

rich is optional (``pip install 'ampguard[cli]'``); it is imported when the exporter is built,
never by ``import ampguard``. Like every exporter, a failure (a closed terminal, a full disk under
a redirected stdout) is contained by :class:`~ampguard.exporters.MultiExporter`: training goes on.
The exporter never replaces ``sys.stdout`` or ``sys.stderr``: what else the program prints while
the table is live lands between redraws (use ``plain=True`` where that matters).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from ..errors import BackendUnavailableError
from ..records import Anomaly, RunInfo, StepReport

__all__ = ["ConsoleExporter"]


def _rich() -> Any:
    try:
        import rich.console
        import rich.live
        import rich.table
    except ImportError:
        raise BackendUnavailableError("ConsoleExporter needs rich: pip install 'ampguard[cli]'") from None
    return rich


def _g(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}" if math.isfinite(v) else str(v)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def anomaly_line(a: Anomaly) -> str:
    """One anomaly in one line: step, kind, origin ranks, where forensics localised it, detail."""
    ranks = f" (rank {','.join(map(str, a.ranks))})" if a.ranks else ""
    where = f" [{a.module}, {a.phase}, {a.cause}]" if a.module else ""
    return f"step {a.step} {a.kind}{ranks}{where}: {a.detail}"


class ConsoleExporter:
    """The run's live view on the terminal, from rank 0 (see the module docstring).

    - ``console``: a ``rich.console.Console`` to draw on (default: a new one on stdout); tests and
      notebooks pass their own (``Console(file=io.StringIO(), force_terminal=True)``).
    - ``refresh_s``: redraw at most this often (seconds); a step with an anomaly redraws at once.
    - ``every``: plain mode: one line every N steps (skipped steps and anomalies always get one).
    - ``plain``: plain lines instead of the live table; default: when the console is not a terminal.
    - ``total_steps``: the run's length, for the progress and the time left (optional).
    - ``all_ranks``: draw on every rank, not only rank 0 (each rank's own view).
    - ``recent``: how many of the last anomalies the table lists.
    """

    def __init__(self, *, console: Any = None, refresh_s: float = 0.25, every: int = 10, plain: bool | None = None,
                 total_steps: int | None = None, all_ranks: bool = False, recent: int = 5) -> None:
        if not (isinstance(refresh_s, (int, float)) and refresh_s >= 0):
            raise ValueError(f"ConsoleExporter refresh_s={refresh_s!r}; allowed: a number of seconds >= 0")
        for name, value, low in (("every", every, 1), ("recent", recent, 0)):
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"ConsoleExporter {name}={value!r}; allowed: an int >= {low}")
        if total_steps is not None and not (isinstance(total_steps, int) and total_steps >= 1):
            raise ValueError(f"ConsoleExporter total_steps={total_steps!r}; allowed: None or an int >= 1")
        rich = _rich()
        self.console = console if console is not None else rich.console.Console()
        self.refresh_s = float(refresh_s)
        self.every = every
        self.plain = (not self.console.is_terminal) if plain is None else bool(plain)
        self.total_steps = total_steps
        self.all_ranks = all_ranks
        self.redraws = 0
        """Times the live table was drawn (or plain lines printed)."""
        self._recent_n = recent
        self._on = False
        self._live: Any = None
        self._reset(None)

    def _reset(self, info: RunInfo | None) -> None:
        self._info = info
        self._last: StepReport | None = None
        self._steps = 0
        self._skips: Counter[str] = Counter()
        self._anomalies = 0
        self._recent: deque[Anomaly] = deque(maxlen=max(self._recent_n, 1))
        self._started = time.monotonic()
        self._drawn_at = -math.inf

    # ------------------------------------------------------------------ the Exporter protocol
    def open(self, info: RunInfo) -> None:
        self._stop()
        self._on = info.rank == 0 or self.all_ranks
        self._reset(info)
        if not self._on:
            return
        if self.plain:
            self._print(f"ampguard run {info.run_id}: {info.precision}, {info.world_size} rank(s), {info.device}")
            return
        from rich.live import Live

        self._live = Live(self.render(), console=self.console, auto_refresh=False, redirect_stdout=False,
                          redirect_stderr=False)
        self._live.start()
        self.redraws += 1
        self._drawn_at = time.monotonic()

    def export(self, report: StepReport, anomalies: Sequence[Anomaly]) -> None:
        if not self._on:
            return
        self._last = report
        self._steps += 1
        if report.skipped:
            self._skips[str(report.reason)] += 1
        self._anomalies += len(anomalies)
        self._recent.extend(anomalies)
        if self.plain:
            for a in anomalies:
                self._print("  ! " + anomaly_line(a))
            if report.skipped or (report.step + 1) % self.every == 0:
                self._print(self.status())
            return
        now = time.monotonic()
        if anomalies or now - self._drawn_at >= self.refresh_s:
            self._draw(now)

    def close(self) -> None:
        if not self._on:
            return
        try:
            if self.plain:
                skips = sum(self._skips.values())
                self._print(f"closed after {self._steps} steps: {skips} skipped, {self._anomalies} anomalies")
            elif self._live is not None:
                self._draw(time.monotonic())
        finally:
            self._stop()
            self._on = False

    # ------------------------------------------------------------------ what is drawn
    def status(self) -> str:
        """The run in one line (what plain mode prints)."""
        r = self._last
        if r is None:
            return "no step yet"
        done = f" [{r.step + 1}/{self.total_steps}]" if self.total_steps else ""
        skips = sum(self._skips.values())
        why = f"SKIPPED ({r.reason})" if r.skipped else "ok"
        return (f"step {r.step:>5}{done}  loss {_g(r.loss):>9}  scale {_g(r.loss_scale):>8}  "
                f"grad norm {_g(r.grad_norm):>9}  skipped {skips}  anomalies {self._anomalies}  {why}")

    def render(self) -> Any:
        """The live table (a rich renderable)."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        info, r = self._info, self._last
        elapsed = time.monotonic() - self._started
        head = f"ampguard run {info.run_id if info else '?'}"
        if info is not None:
            head += f": {info.precision}, {info.world_size} rank(s)"
        progress = ""
        if r is not None:
            done = r.step + 1
            progress = f"{done}" + (f"/{self.total_steps}" if self.total_steps else "") + " steps"
            if elapsed > 0 and self._steps > 1:
                rate = self._steps / elapsed
                progress += f", {rate:.3g} steps/s"
                if self.total_steps and self.total_steps > done:
                    progress += f", {_duration((self.total_steps - done) / rate)} left"
        table = Table(expand=False)
        for col in ("step", "loss", "loss scale", "grad norm", "skipped", "anomalies", "last step"):
            table.add_column(col, justify="right")
        if r is None:
            table.add_row("-", "-", "-", "-", "0", "0", "starting")
        else:
            skips = sum(self._skips.values())
            pct = f" ({100 * skips / self._steps:.1f}%)" if self._steps else ""
            last = f"[red]skipped: {r.reason}[/red]" if r.skipped else "[green]ok[/green]"
            table.add_row(str(r.step), _g(r.loss), _g(r.loss_scale), _g(r.grad_norm), f"{skips}{pct}",
                          str(self._anomalies), last)
        parts: list[Any] = [Text(f"{head}   {progress}".rstrip(), style="bold"), table]
        if self._skips:
            parts.append("skipped by reason: " + ", ".join(f"{k} {n}" for k, n in self._skips.most_common()))

        def detail(text: str) -> Text:
            out = Text(" ".join(text.split()))
            out.truncate(70, overflow="ellipsis")
            return out

        if self._recent and self._recent_n:
            recent = Table(title="last anomalies", title_justify="left", expand=False)
            for col in ("step", "kind", "ranks", "module", "phase", "cause", "detail"):
                # Only the detail gives way on a narrow terminal (it wraps); the other columns keep their words.
                recent.add_column(col, justify="right" if col == "step" else "left", no_wrap=col != "detail")
            for a in self._recent:
                recent.add_row(str(a.step), str(a.kind), ",".join(map(str, a.ranks)) or "-", a.module or "-",
                               str(a.phase or "-"), str(a.cause or "-"), detail(a.detail))
            parts.append(recent)
        return Group(*parts)

    # ------------------------------------------------------------------ internals
    def _draw(self, now: float) -> None:
        self._drawn_at = now
        self.redraws += 1
        self._live.update(self.render(), refresh=True)

    def _print(self, line: str) -> None:
        self.redraws += 1
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _stop(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()

    def __repr__(self) -> str:
        return f"ConsoleExporter(plain={self.plain}, refresh_s={self.refresh_s:g}, total_steps={self.total_steps})"
