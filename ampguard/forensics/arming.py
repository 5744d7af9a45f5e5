"""The guard's forensics state: when hooks are armed, what they found, and the replay.

:class:`~ampguard.forensics.localizer.Localizer` does the looking; :class:`Forensics` decides when to
look and carries what was found to the report of its step. Healthy runs pay nothing: no hook
exists until a step goes non-finite. Arming and disarming happen only at the guard's fixed
points (``after_report``), the same step on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..backends.base import Backend
from ..config import GuardConfig
from ..records import Anomaly, SkipReason, StepReport
from ..stats import Dec, Loc, origin_ranks
from ..vocab import AnomalyKind, Cause, Phase
from .localizer import Finding, Localizer
from .sentinel import Sentinel

if TYPE_CHECKING:
    from ..scaling import GradScalerAdapter

__all__ = ["Forensics", "annotate"]

_NONFINITE_KINDS = (AnomalyKind.NONFINITE_LOSS, AnomalyKind.NONFINITE_GRAD, AnomalyKind.OVERFLOW)


def annotate(anomalies: list[Anomaly], finding: Finding | None) -> list[Anomaly]:
    """The step's first non-finite anomaly, with what forensics found (module, phase, cause; the
    parameter it names first among the anomaly's parameters); and the step's fp8 anomaly, which keeps
    the cast it names (module, phase) and gains the cause and where the non-finite value came from."""
    if finding is None:
        return anomalies
    at = next((i for i, a in enumerate(anomalies) if a.kind in _NONFINITE_KINDS), None)
    if at is not None:
        anomalies[at] = _found(anomalies[at], finding)
    for i, anomaly in enumerate(anomalies):
        if anomaly.kind == AnomalyKind.FP8_NONFINITE:
            where = f"the first non-finite value arose at {finding.module or 'the model'} ({finding.phase}): " if (
                finding.phase is not None and finding.phase != Phase.INPUT) else ""
            anomalies[i] = dataclasses.replace(anomaly, cause=finding.cause,
                                               detail=f"{anomaly.detail}. Forensics: {where}{finding.detail}")
    return anomalies


def _found(first: Anomaly, finding: Finding) -> Anomaly:
    kind = first.kind
    if kind == AnomalyKind.OVERFLOW and finding.cause in (Cause.NAN, Cause.TRANSIENT):
        kind = AnomalyKind.NONFINITE_GRAD  # fp16, but forensics found a NaN the scale did not cause
    params = first.params
    if finding.param is not None:
        params = (finding.param, *(p for p in params if p != finding.param))[:max(len(params), 1)]
    # A finding that says nothing of where (a clean replay of an unobserved step) keeps what the
    # sentinel saw on this step, or nothing; else module and phase are the finding's, None included.
    module, phase = (finding.module, finding.phase) if finding.phase is not None else (first.module, first.phase)
    return dataclasses.replace(
        first, kind=kind, module=module, phase=phase, cause=finding.cause,
        params=params, detail=f"{first.detail}. Forensics: {finding.detail}",
    )


class Forensics:
    """Arms a :class:`Localizer` after a non-finite step, collects findings on armed steps, and
    replays a step on request. ``findings`` is the reporter's dict: a finding waits there for
    its step's report."""

    def __init__(self, *, model: torch.nn.Module | None, config: GuardConfig, backend: Backend, fp16: bool,
                 findings: dict[int, Finding], device: torch.device) -> None:
        if config.sentinel is not None and model is None:
            raise ValueError("GuardConfig.sentinel needs the model: pass ampguard.wrap(..., model=model)")
        self.sentinel = Sentinel(model, config.sentinel, device) if model is not None and config.sentinel else None
        """The opt-in coarse sentinel (None: off)."""
        self.model = model
        self.config = config
        self.backend = backend
        self.fp16 = fp16
        self.findings = findings
        self.localizer: Localizer | None = None
        self._outside_of: set[str | None] = {None}
        """Blocks the fault was found to arise outside of: the hooks then watch the whole model."""
        self.live_from = 0
        """The first step whose forward the armed hooks saw from its start."""
        self._clean = 0
        self._uncured = False
        """The last report seen was non-finite and backed the loss scale off (or found it at ``min_scale``): a
        non-finite step next is a fault that backing off did not cure, and arms even where it looks routine."""
        self.replaying = False
        """True while a replay closure runs: its ``backward()`` scales and back-propagates only."""
        self.replay_loss: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return self.config.forensics and self.model is not None

    @property
    def armed(self) -> bool:
        return self.localizer is not None and self.localizer.armed

    def after_report(self, report: StepReport, next_forward: int, block: str | None = None) -> None:
        """Fixed point: arm after a non-finite step (hooks from the next forward on: that of step
        ``next_forward``), disarm after ``forensics_window`` clean ones. ``block``: the block the
        sentinel named on that step: the hooks arm inside it only (again if they watched another)."""
        uncured = self._uncured
        self._uncured = report.nonfinite and (report.scale_backoff or report.next_loss_scale <= self.config.min_scale)
        if report.nonfinite:
            self._clean = 0
            if not self.enabled or (not uncured and self._routine(report, block)):
                return
            target = block if block not in self._outside_of else None
            within = self.localizer.within if self.localizer is not None else None
            if within is not None and (within in self._outside_of or target not in (None, within)):
                self.remove()  # another block, or the whole model: the fault arose outside this one
            self.arm(next_forward, within=target)
        elif self.localizer is not None:
            self._clean += 1
            if self._clean >= self.config.forensics_window:
                self.remove()

    def arm(self, next_forward: int, within: str | None = None) -> None:
        """The localizer's hooks, live from the forward of step ``next_forward`` on, on the modules inside ``within``
        (a block's name; None: the whole model); nothing where they are armed already (``remove()`` first to move
        them). :meth:`after_report` arms through it, and so does ``benchmarks/armed_cost.py``."""
        if self.localizer is None:
            assert self.model is not None  # internal: the caller checked enabled
            self.localizer = Localizer(self.model, within=within)
            self.live_from = next_forward

    def _routine(self, report: StepReport, block: str | None) -> bool:
        """An overflow of a GradScaler's fp16 backward that the loss scale has not yet been backed off for: finite
        loss, no fp8 cast and no block that the sentinel named. That is the loss scale at work (GradScaler's growth
        overshoots by design, every ``growth_interval`` steps; with ``hysteresis`` > 1 the first overflows after a
        growth come in a row before it backs off): arming on it cost ``forensics_window`` steps of hooks on every
        module and a host sync each. A fault that lasts is still there on the step after the back-off, and arms
        then; a non-finite loss arms at once."""
        return (self.fp16 and not report.nonfinite_loss and report.reason != SkipReason.NONFINITE_FP8
                and block is None)

    def remove(self) -> None:
        if self.localizer is not None:
            self.localizer.remove()
            self.localizer = None

    def close(self) -> None:
        self.remove()
        if self.sentinel is not None:
            self.sentinel.remove()

    def collect(self, step: int, decision: torch.Tensor, gathered: torch.Tensor) -> None:
        """Armed steps only: read the hooks' flags (one host sync) and keep what they name.
        Before clipping, which would turn an inf times a 0 coefficient into NaN."""
        assert self.localizer is not None  # internal: only called when armed
        if step < self.live_from:
            # Armed during this step (a lagged report): its forward ran unobserved. Naming nothing
            # beats naming "the loss" for want of records. The same step on every rank.
            self.localizer.reset()
            return
        loss_finite = not bool(decision[Dec.LOSS_NONFINITE] > 0)  # SYNC (armed steps only)
        grad_bad = bool(decision[Dec.GRAD_NONFINITE] > 0)
        local_loss_finite = not bool(gathered[self.backend.rank, Loc.LOSS_NONFINITE] > 0)
        finding = self.localizer.collect(loss_finite=local_loss_finite, fp16_scaling=self.fp16)
        if grad_bad or not loss_finite:  # the same on every rank: the share below is a collective
            shared = self.share(finding, gathered)
            within = self.localizer.within
            if within is not None and shared is not None and shared.module is None and shared.cause is None:
                self._outside_of.add(within)  # agreed on every rank: widen at the next fixed point
            self._keep(step, shared)

    def share(self, finding: Finding | None, gathered: torch.Tensor) -> Finding | None:
        """Every rank localises its own; all agree on the view of the first rank where the
        non-finite values originated. collective (non-finite armed steps only; blocks)."""
        rank = self.backend.rank
        if self.backend.world_size == 1:
            return dataclasses.replace(finding, rank=rank) if finding is not None else None
        views = self.backend.all_gather_object(finding)
        origins = origin_ranks(gathered.float().cpu().tolist())
        order = [*origins, *(r for r in range(len(views)) if r not in origins)]
        candidates = [r for r in order if views[r] is not None]
        # a module (or the input) beats "the loss itself" and "outside the watched block"
        candidates.sort(key=lambda r: views[r].module is None and views[r].phase != Phase.INPUT)
        if not candidates:
            return None
        r = candidates[0]
        view = views[r]
        prefix = f"rank {r}: "
        detail = view.detail if view.detail.startswith(prefix) else prefix + view.detail
        return dataclasses.replace(view, rank=r, detail=detail)

    def replay_if_nonfinite(self, step: int, closure: Callable[[], Any], decision: torch.Tensor,
                            gathered: torch.Tensor, optimizer: torch.optim.Optimizer,
                            adapter: GradScalerAdapter | None) -> None:
        """``step(closure, replay=True)``: on a non-finite step (one host sync to learn it), with
        forensics on, :meth:`replay` at the step's loss scale."""
        if not self.enabled or not bool(decision[Dec.LOSS_NONFINITE] + decision[Dec.GRAD_NONFINITE] > 0):  # SYNC
            return
        scale = None if adapter is None else (lambda: adapter.at_scale(decision[Dec.SCALE]))
        self.replay(step, closure, scale=scale, gathered=gathered, optimizer=optimizer)

    def replay(self, step: int, closure: Callable[[], Any], *,
               scale: Callable[[], contextlib.AbstractContextManager[Any]] | None, gathered: torch.Tensor,
               optimizer: torch.optim.Optimizer) -> None:
        """Re-run ``closure`` on the same batch, with hooks armed, at the loss scale of the step
        (``scale``: a context manager factory, or None without loss scaling)."""
        assert self.model is not None  # internal: only called with a model
        localizer = self.localizer if self.localizer is not None else Localizer(self.model)
        temporary = self.localizer is None
        self.replaying, self.replay_loss = True, None
        try:
            localizer.reset()
            with torch.enable_grad(), (scale() if scale is not None else contextlib.nullcontext()):
                closure()
                self.backend.before_unscale(optimizer)  # Horovod: finish the replay's all-reduce
            self._keep(step, self.share(self._replay_finding(step, localizer, optimizer), gathered))
        finally:
            self.replaying = False
            if temporary:
                localizer.remove()
            if self.sentinel is not None:
                self.sentinel.clear()  # the replay's forward belongs to no step's report
            self.backend.zero_grad(optimizer, True)

    def _replay_finding(self, step: int, localizer: Localizer, optimizer: torch.optim.Optimizer) -> Finding:
        """The replay decides persistence: reproduced -> the cause stays what the recompute found
        (never ``transient``); clean -> ``transient``."""
        loss_finite = self.replay_loss is not None and bool(torch.isfinite(self.replay_loss))
        grads_finite = all(
            bool(torch.isfinite(p.grad).all())
            for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        )
        first_pass = self.findings.get(step)  # what armed hooks saw on the first pass
        if first_pass is not None and first_pass.rank != self.backend.rank:
            first_pass = None  # another rank's view; this rank localises its own replay
        if loss_finite and grads_finite:
            localizer.reset()
            clean = "a replay of the same batch was clean: suspect hardware or a race"
            if first_pass is not None:
                return dataclasses.replace(first_pass, cause=Cause.TRANSIENT, persistent=False,
                                           detail=f"{first_pass.detail}; {clean}")
            return Finding(None, None, Cause.TRANSIENT, "", math.nan,
                           f"{clean} (the hooks were not armed on the first pass: where is unknown)",
                           persistent=False)
        found = localizer.collect(loss_finite=loss_finite, fp16_scaling=self.fp16) or first_pass
        again = "a replay of the same batch reproduced it: persistent"
        if found is None:
            return Finding(None, None, None, "", math.nan, f"{again}, outside every module hook", persistent=True)
        return dataclasses.replace(found, persistent=True, detail=f"{found.detail}; {again}")

    def _keep(self, step: int, finding: Finding | None) -> None:
        if finding is not None:
            self.findings[step] = finding

