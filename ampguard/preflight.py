"""Preflight: try the run on one device, small, before going wide.

:func:`preflight` builds a fresh model, optimizer and batches from your factories for each
candidate precision, trains a few steps with the guard on, and recommends a precision, an
initial loss scale (the largest power of two below every scale that overflowed in the
trial, divided by ``2**margin``), a growth interval, and a :class:`~ampguard.GuardConfig` you can pass
straight to :func:`~ampguard.wrap`. It measures (never estimates) the overflow rate, the
gradient-norm range and, on CUDA, the peak memory against an fp32 trial. Your own model and
optimizer are never touched: everything is built fresh by the factories.

The candidate ``"fp8"`` is torchao float8 training (:mod:`ampguard.preflight_fp8`): the fresh model
converted with ``convert_to_float8_training`` and trained under bf16 autocast, every cast measured
per layer and role; the recommendation's :class:`~ampguard.preflight_fp8.Fp8Advice` says which
layers should stay in bf16 and why.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .config import GuardConfig
from .errors import AmpGuardError
from .hardware import UnsupportedPrecisionError, check_precision
from .preflight_fp8 import Filter, Fp8Advice, Fp8CastStats, Fp8Trial, Setup, advise, setup

__all__ = ["PRECISIONS", "Fp8Advice", "Fp8CastStats", "Recommendation", "Trial", "preflight"]

PRECISIONS = ("fp16", "bf16", "fp32", "fp8")
"""The candidates ``preflight(precision=)`` takes; "fp8" is torchao float8 training under bf16 autocast."""

_PROBE_SCALE = 2.0**24  # start high: the backoffs in the first steps find the usable scale
WARN_AFTER_S = 120.0
"""``preflight(warn_after_s=)``'s default: warn when the trials are estimated to take longer."""

log = logging.getLogger("ampguard.preflight")

Progress = Callable[[int, int, str], None]
"""``progress(done, total, precision)``: trial steps done of all the preflight will run, as each trial
starts and after each step."""


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.2g} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Watch:
    """Counts the trial steps, reports progress, and warns once when a trial step is slow for its
    device, before the trials have run for long: from the first step on CPU, from the second on CUDA
    (the first pays one-time warm-up there). That step's time, times every step of the preflight, is
    the estimate; and where that step alone runs past ``warn_after_s / steps in all``, a timer warns
    while it still runs (an fp16 step of a large model on a CPU can take minutes by itself)."""

    def __init__(self, total: int, candidates: int, steps: int, device: torch.device, warn_after_s: float | None,
                 progress: Progress | None) -> None:
        self.total, self.candidates, self.steps, self.device = total, candidates, steps, device
        self.warn_after_s, self.progress = warn_after_s, progress
        self.done = 0
        self.estimate_s: float | None = None
        """The whole preflight's estimated time, once measured (seconds)."""
        self._timed = 0
        self._warned = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def begin(self, precision: str) -> None:
        """A trial starts."""
        if self.progress is not None:
            self.progress(self.done, self.total, precision)

    def _deciding(self) -> bool:
        """The step under way is the one the estimate comes from."""
        return self._timed == (1 if self.device.type == "cuda" else 0)

    def step_starts(self, precision: str) -> None:
        if self.warn_after_s is not None and self._deciding() and not self._warned:
            limit = self.warn_after_s / self.total
            self._timer = threading.Timer(limit, self._warn, (precision, limit, False))
            self._timer.daemon = True
            self._timer.start()

    def step(self, precision: str, seconds: float) -> None:
        self.done += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._deciding():
            self.estimate_s = seconds * self.total
            if self.warn_after_s is not None and self.estimate_s > self.warn_after_s:
                self._warn(precision, seconds, True)
        self._timed += 1
        if self.progress is not None:
            self.progress(self.done, self.total, precision)

    def _warn(self, precision: str, seconds: float, done: bool) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        what = "takes" if done else "has run for"
        more = "" if done else " and is not done"
        about = "about" if done else "more than"
        log.warning(
            "a %s trial step %s %.3g s on %s%s: %d steps x %d candidate(s) will take %s %s. Preflight needs "
            "the model's numerics, not its full size: try a smaller model or batch (fewer layers, a shorter "
            "sequence), fewer steps (steps=, --steps), or a GPU (device='cuda', --device cuda)%s", precision, what,
            seconds, self.device, more, self.steps, self.candidates, about, _duration(seconds * self.total),
            "; fp16 on a CPU is slow: try bf16 (--precision bf16)" if self.device.type == "cpu" and
            precision == "fp16" else "")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


@dataclasses.dataclass(frozen=True)
class Trial:
    """What one precision did in the preflight run."""

    precision: str
    steps: int
    skipped: int
    overflow_steps: int
    """Steps whose gradients overflowed (fp16) or were non-finite, after the scale settled."""
    settle_steps: int
    """Leading steps spent backing the probe scale off (fp16) before the first clean step."""
    overflow_rate: float
    """``overflow_steps / (steps - settle_steps)``."""
    largest_clean_scale: float | None
    """fp16: the largest power of two below every scale that overflowed during the trial."""
    grad_norm_min: float
    grad_norm_max: float
    loss_first: float
    loss_last: float
    peak_memory_bytes: int | None
    """``torch.cuda.max_memory_allocated`` over the trial; None off CUDA (nothing rather than a wrong number)."""
    error: str | None = None
    """Why the trial could not run (e.g. the device cannot run this precision)."""
    first_anomaly: str | None = None
    step_time_s: float | None = None
    """The median step time after the first step (which pays warm-up), in seconds."""


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The preflight's advice. ``opt = ampguard.wrap(optimizer, model=model, **rec.wrap_kwargs())``.

    ``precision`` "fp8": convert the model first with ``convert_to_float8_training(model, config=...,
    module_filter_fn=rec.fp8.module_filter_fn)``; the guard then runs at "bf16" (:meth:`wrap_kwargs` says so)."""

    precision: str
    init_scale: float | None
    growth_interval: int | None
    config: GuardConfig
    trials: tuple[Trial, ...]
    fp32_peak_memory_bytes: int | None
    reason: str
    fp8: Fp8Advice | None = None
    """What the fp8 trial measured per layer and role, and which layers should stay in bf16 (None without one)."""

    def scaler_kwargs(self) -> dict[str, Any]:
        """Arguments for ``torch.amp.GradScaler(device, **kwargs)`` ({} without loss scaling)."""
        if self.init_scale is None:
            return {}
        return {"init_scale": self.init_scale, "growth_interval": self.growth_interval}

    def wrap_kwargs(self, device: str | torch.device = "cuda") -> dict[str, Any]:
        """``precision``, ``config`` and (fp16) a ``scaler`` built from :meth:`scaler_kwargs`. For "fp8" the
        precision is "bf16": torchao float8 trains under bf16 autocast."""
        kw: dict[str, Any] = {"precision": "bf16" if self.precision == "fp8" else self.precision,
                              "config": self.config}
        if self.precision == "fp16":
            kw["scaler"] = torch.amp.GradScaler(torch.device(device).type, **self.scaler_kwargs())
        return kw

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # the config's parts (Spikes, ...) as mappings GuardConfig.from_dict reads

    def __str__(self) -> str:
        lines = [f"preflight recommendation: precision={self.precision}"
                 + (f", init_scale={self.init_scale:g}, growth_interval={self.growth_interval}"
                    if self.init_scale is not None else ""),
                 f"  why: {self.reason}"]
        for t in self.trials:
            if t.error:
                lines.append(f"  {t.precision:>4}: not run: {t.error}")
                continue
            mem = f", peak memory {t.peak_memory_bytes / 2**20:.1f} MiB" if t.peak_memory_bytes is not None else ""
            if t.peak_memory_bytes is not None and self.fp32_peak_memory_bytes:
                mem += f" ({t.peak_memory_bytes / self.fp32_peak_memory_bytes:.2f}x fp32)"
            scale = f", largest clean scale {t.largest_clean_scale:g}" if t.largest_clean_scale else ""
            lines.append(
                f"  {t.precision:>4}: {t.steps} steps, {t.skipped} skipped ({t.settle_steps} settling the scale), "
                f"overflow rate {t.overflow_rate:.3f}{scale}, grad norm {t.grad_norm_min:.3g}..{t.grad_norm_max:.3g}, "
                f"loss {t.loss_first:.4g} -> {t.loss_last:.4g}{mem}"
                + (f", {t.step_time_s * 1e3:.3g} ms/step" if t.step_time_s is not None else "")
                + (f"; first anomaly: {t.first_anomaly}" if t.first_anomaly else "")
            )
        if self.fp8 is not None:
            lines += self.fp8.lines()
        return "\n".join(lines)


def _trial(model_fn: Callable[[], torch.nn.Module], batch_fn: Callable[[int], Any],
           optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer], loss_fn: Callable[..., Any],
           precision: str, steps: int, device: torch.device, growth_interval: int, watch: _Watch,
           fp8: Setup | None = None) -> tuple[Trial, Fp8Trial | None]:
    """One precision's trial; for "fp8" (``fp8`` set) also its measured casts."""
    from .factory import wrap

    def failed(why: str) -> tuple[Trial, None]:
        return Trial(precision, 0, 0, 0, 0, math.nan, None, math.nan, math.nan, math.nan, math.nan, None, why), None

    try:
        check_precision("bf16" if precision == "fp8" else precision, device)
    except UnsupportedPrecisionError as exc:
        return failed(str(exc))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        # Process-wide: the device's peak-memory counter is the only measure of a trial's peak, so it is
        # reset here, and a caller's own max_memory_allocated() reading before the preflight is lost (it
        # cannot be restored). Preflight is a trial run of its own; the guard never resets it.
        torch.cuda.reset_peak_memory_stats(device)
    model = model_fn().to(device)
    casts = None
    if fp8 is not None:
        try:
            casts = Fp8Trial(model, fp8)
        except ValueError as exc:
            return failed(str(exc))
        model = casts.model
    inner = optimizer_fn(model.parameters())
    scaler = None
    if precision == "fp16":
        scaler = torch.amp.GradScaler(device.type, init_scale=_PROBE_SCALE, growth_interval=growth_interval)
    # an fp8 trial: the guard's own fp8 monitoring samples every cast on every step (underflow included)
    opt = wrap(inner, model=model, precision="bf16" if precision == "fp8" else precision,  # type: ignore[arg-type]
               scaler=scaler, config=GuardConfig(min_scale=2.0**-14, forensics=False, history_size=max(steps, 1),
                                                 numerics_every=1 if casts is not None else None))
    watch.begin(precision)
    times = []
    try:
        for i in range(steps):
            watch.step_starts(precision)
            started = time.perf_counter()
            batch = batch_fn(i)
            with opt.autocast():
                loss = loss_fn(model, batch)
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)  # a trial: the step's real time, not its launch
            times.append(time.perf_counter() - started)
            watch.step(precision, times[-1])
    except RuntimeError as exc:
        if casts is None or "divisible by 16" not in str(exc):
            raise
        opt.close()
        return failed(f"torchao's fp8 matmul (torch._scaled_mm) refused a shape: {exc}. It needs the dimensions "
                      "it multiplies to be multiples of 16: leave out the layers whose in_features or "
                      "out_features are not (fp8_filter=lambda m, fqn: m.in_features % 16 == 0 and "
                      "m.out_features % 16 == 0); where it is the batch's token count (the weight gradient's "
                      "inner dimension), fp8_config=Float8LinearConfig(pad_inner_dim=True) pads it")
    opt.flush()
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    reports = list(opt.history)
    opt.close()
    if casts is not None:
        casts.close(reports)
    settle = 0
    if precision == "fp16":
        for r in reports:
            if not r.skipped:
                break
            settle += 1
    after = reports[settle:]
    bad = sum(r.nonfinite for r in after)
    clean = [r for r in reports if not r.skipped]
    norms = [r.grad_norm for r in clean if math.isfinite(r.grad_norm)]
    losses = [r.loss for r in clean if r.loss is not None and math.isfinite(r.loss)]
    anomalies = [a for a in opt.anomalies if a.step >= settle]
    trial = Trial(
        precision=precision,
        steps=len(reports),
        skipped=sum(r.skipped for r in reports),
        overflow_steps=bad,
        settle_steps=settle,
        overflow_rate=bad / max(len(after), 1),
        largest_clean_scale=_largest_clean(reports) if precision == "fp16" else None,
        grad_norm_min=min(norms, default=math.nan),
        grad_norm_max=max(norms, default=math.nan),
        loss_first=losses[0] if losses else math.nan,
        loss_last=losses[-1] if losses else math.nan,
        peak_memory_bytes=peak,
        first_anomaly=f"step {anomalies[0].step}: {anomalies[0].detail}" if anomalies else None,
        step_time_s=statistics.median(times[1:]) if len(times) > 1 else None,
    )
    return trial, casts


def _largest_clean(reports: Sequence[Any]) -> float:
    """The largest power of two below every scale at which the gradients overflowed."""
    overflowed = [r.loss_scale for r in reports if r.nonfinite_grads > 0]
    if not overflowed:
        return max(r.loss_scale for r in reports)
    return float(2.0 ** (math.ceil(math.log2(min(overflowed))) - 1))


def _default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = model(x)
    if y.dtype in (torch.long, torch.int64, torch.int32):
        return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
    return torch.nn.functional.mse_loss(out.float(), y.float())


# Long (~60 lines) because of its docstring; the body is one loop over precisions.
def preflight(
    model_fn: Callable[[], torch.nn.Module],
    batch_fn: Callable[[int], Any],
    optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    *,
    steps: int = 50,
    precision: Sequence[str] | str = ("fp16", "bf16"),
    device: str | torch.device | None = None,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    margin: int = 1,
    growth_interval: int = 2000,
    warn_after_s: float | None = WARN_AFTER_S,
    progress: Progress | None = None,
    fp8_config: Any = None,
    fp8_filter: Filter | None = None,
) -> Recommendation:
    """Try each candidate precision on one device for ``steps`` steps and recommend one.

    - ``model_fn()`` -> a fresh model; ``batch_fn(i)`` -> batch ``i`` (already on ``device``, or
      moved by your loss); ``optimizer_fn(params)`` -> a fresh optimizer.
    - ``loss_fn(model, batch)`` -> scalar loss; default: ``batch = (x, y)``, cross-entropy for
      integer targets, MSE otherwise.
    - ``margin``: the recommended ``init_scale`` is the largest clean power of two / ``2**margin``.

    - ``warn_after_s``: log a warning (logger ``ampguard.preflight``) as soon as the first trial step
      (the second on CUDA, where the first pays warm-up) says the whole preflight will take longer
      than this: when it ends, or while it still runs once it has taken ``warn_after_s`` / (the
      preflight's steps); with the estimate and what to change. None: never.
    - ``progress(done, total, precision)``: called as each trial starts and after each of its steps
      (``ampguard preflight`` draws its progress bar from it).
    - ``precision`` "fp8": torchao float8 training under bf16 autocast (``pip install 'ampguard[fp8]'``;
      checked before any trial runs). ``fp8_config``: the ``torchao.float8.Float8LinearConfig`` to try
      (default: torchao's default), emulated (``emulate=True``) where the device has no fp8 matmul (a CPU,
      CUDA below compute capability 8.9), as ``rec.fp8.emulated`` says; ``fp8_filter``: the
      ``module_filter_fn`` to convert with (default: every ``nn.Linear``). ``rec.fp8`` holds each cast's
      worst amax, scale, underflow and dynamic range over the trial, and the layers to keep in bf16.

    Runs on one device (default: CUDA if available, else CPU); synchronises freely: it is a
    trial, not a training run. Also runs an fp32 trial on CUDA to measure the memory saved; on CUDA
    it resets the device's peak-memory statistics (``torch.cuda.reset_peak_memory_stats``) before
    each trial.
    """
    if isinstance(precision, str):
        precision = (precision,)
    bad = [p for p in precision if p not in PRECISIONS]
    if bad or not precision:
        raise ValueError(f"preflight precision={tuple(precision)!r}; allowed: a sequence of "
                         + ", ".join(repr(p) for p in PRECISIONS))
    if not (isinstance(steps, int) and steps >= 5):
        raise ValueError(f"preflight steps={steps!r}; allowed: an int >= 5")
    if warn_after_s is not None and not (isinstance(warn_after_s, (int, float)) and warn_after_s > 0):
        raise ValueError(f"preflight warn_after_s={warn_after_s!r}; allowed: None or a number of seconds > 0")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fp8 = None
    if "fp8" in precision:
        fp8 = setup(fp8_config, fp8_filter, dev)  # a missing or untested torchao is refused before any trial
    elif fp8_config is not None or fp8_filter is not None:
        raise ValueError("preflight fp8_config= and fp8_filter= set up the fp8 trial: add 'fp8' to precision, "
                         "or leave them out")
    loss_fn = loss_fn or _default_loss
    extra = min(steps, 5) if dev.type == "cuda" and "fp32" not in precision else 0
    watch = _Watch(steps * len(precision) + extra, len(precision), steps, dev, warn_after_s, progress)
    try:
        outcomes = [_trial(model_fn, batch_fn, optimizer_fn, loss_fn, p, steps, dev, growth_interval, watch,
                           fp8 if p == "fp8" else None) for p in precision]
        trials = [t for t, _ in outcomes]
        fp8_trial = next((c for _, c in outcomes if c is not None), None)
        fp32_peak = None
        if dev.type == "cuda":
            fp32 = next((t for t in trials if t.precision == "fp32"), None) or _trial(
                model_fn, batch_fn, optimizer_fn, loss_fn, "fp32", min(steps, 5), dev, growth_interval, watch)[0]
            fp32_peak = fp32.peak_memory_bytes
    finally:
        watch.close()

    usable = [t for t in trials if t.error is None and t.steps and t.overflow_rate < 0.05
              and math.isfinite(t.loss_last)]
    order = {"fp8": 0, "bf16": 1, "fp16": 2, "fp32": 3}  # fp8 when asked and clean; bf16 needs no scaler; fp32 last
    if not usable:
        ran = [t for t in trials if t.error is None]
        if not ran:
            raise AmpGuardError("preflight could not run any candidate precision: "
                                + "; ".join(f"{t.precision}: {t.error}" for t in trials))
        choice = min(ran, key=lambda t: (t.overflow_rate, order[t.precision]))
        reason = (f"no candidate stayed below a 5% non-finite rate; {choice.precision} did best "
                  f"({choice.overflow_rate:.1%}): fix the model or data before a long run")
    else:
        choice = min(usable, key=lambda t: order[t.precision])
        reason = f"{choice.precision} trained {choice.steps} steps with {choice.overflow_rate:.1%} non-finite steps"
        if choice.precision in ("bf16", "fp8"):
            reason += " and needs no loss scaling"
    init_scale = interval = None
    if choice.precision == "fp16":
        largest = choice.largest_clean_scale or 1.0
        init_scale = float(2.0 ** max(0, math.floor(math.log2(largest)) - margin))
        interval = growth_interval
        reason += f"; init_scale {init_scale:g} = largest clean scale {largest:g} / 2**{margin}"
    config = GuardConfig(hysteresis=2 if choice.precision == "fp16" else 1)
    advice = None
    if fp8 is not None and fp8_trial is not None:
        advice = _fp8_advice(fp8, fp8_trial, trials)
        if choice.precision == "fp8":
            kept = ", ".join(advice.keep_bf16) if advice.keep_bf16 else "no layer"
            reason += (f"; convert with rec.fp8.module_filter_fn ({kept} kept in bf16), the guard at "
                       f"precision='bf16'")
    return Recommendation(choice.precision, init_scale, interval, config, tuple(trials), fp32_peak, reason, advice)


def _fp8_advice(fp8: Setup, casts: Fp8Trial, trials: Sequence[Trial]) -> Fp8Advice:
    """The fp8 trial's advice, compared with the bf16 trial where both ran."""
    f8 = next(t for t in trials if t.precision == "fp8")
    bf16 = next((t for t in trials if t.precision == "bf16" and t.error is None), None)
    loss = time_ratio = None
    if bf16 is not None:
        if math.isfinite(f8.loss_last) and math.isfinite(bf16.loss_last):
            loss = f8.loss_last - bf16.loss_last
        if f8.step_time_s and bf16.step_time_s:
            time_ratio = f8.step_time_s / bf16.step_time_s
    return advise(casts.casts, casts.converted, fp8, bf16_nonfinite=None if bf16 is None else bf16.overflow_steps > 0,
                  loss_vs_bf16=loss, time_vs_bf16=time_ratio)
