"""GuardedOptimizer: the façade. The Optimizer surface, ``backward``, ``step``, ``zero_grad``,
the readers and the state dict; the work is done by the rooms it delegates to
(:mod:`~ampguard.pipeline`, :mod:`~ampguard.reporter`, :mod:`~ampguard.diagnosis`,
:mod:`~ampguard.scaling`, :mod:`~ampguard.backends`). Build it with :func:`ampguard.wrap`.
"""

from __future__ import annotations

import enum
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch.utils.hooks import RemovableHandle

from . import checkpoint
from .config import GuardConfig
from .diagnosis import Forensics
from .errors import GuardStateError, RankDivergenceError
from .escalation import Ladder
from .exporters.base import Exporter, MultiExporter
from .pipeline import LossMeter, StepPipeline, grad_marks, payload
from .report import Anomaly, History, RunInfo, StepReport
from .scaling import GradScalerAdapter
from .vocab import AnomalyKind, SkipReason

__all__ = ["GuardedOptimizer", "Stage", "param_names"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> tuple[str, ...]:
    """Parameter names in ``param_groups`` order, as the user wrote them (no DDP ``module.``, no
    ``torch.compile`` ``_orig_mod.``); ``group{g}.param{i}`` where the model does not name one."""
    known: dict[int, str] = {}
    if model is not None:
        inner_model = getattr(model, "module", model)  # DDP / DataParallel wrappers
        for name, p in inner_model.named_parameters():
            known.setdefault(id(p), name.replace("_fsdp_wrapped_module.", "").replace("_orig_mod.", ""))
    return tuple(known.get(id(p), f"group{gi}.param{pi}")
                 for gi, group in enumerate(optimizer.param_groups) for pi, p in enumerate(group["params"]))


class Stage(enum.Enum):
    """Where the guard is in one iteration."""

    READY = "ready"  # after zero_grad() (or wrap())
    ACCUMULATING = "accumulating"  # one or more opt.backward() since
    STEPPED = "stepped"  # after step(), until zero_grad()


class GuardedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that guards each step of the optimizer it wraps.

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects, so LR
    schedulers, ``isinstance`` checks and code that edits ``param_groups[i]["lr"]`` work unchanged.

    Per iteration: ``backward(loss)`` (one or more times, for accumulation), ``step()``,
    ``zero_grad()``. The gradients may also come from a backward the guard did not run (a
    framework's, ``loss.backward()``, or ``opt.scaler.scale(loss).backward()``): ``step()`` then
    checks and decides on the gradients, with the loss given by :meth:`observe_loss` if any.
    Calls out of order raise :class:`GuardStateError` naming the call to make instead, before
    touching model, optimizer or scaler.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, precision: str, scaler: torch.amp.GradScaler | None,
                 config: GuardConfig, model: torch.nn.Module | None, exporters: Sequence[Exporter], backend: Any,
                 device: torch.device, run_info: Callable[[GuardedOptimizer], RunInfo],
                 on_rollback: Callable[[Any, int], None] | None = None,
                 on_abort: Callable[[Any, str], None] | None = None) -> None:
        # torch.optim.Optimizer.__init__ is not called: it would build param_groups of its own.
        # These are the attributes its methods (hooks, profiling, repr) rely on.
        for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):
            setattr(self, f"_optimizer_{kind}_hooks", OrderedDict())
        self.optimizer, self.precision, self.scaler, self.config = optimizer, precision, scaler, config
        self.model, self.backend, self.device, self.dtype = model, backend, device, _DTYPES[precision]
        self._scaler = GradScalerAdapter(scaler) if scaler is not None else None
        self._pipeline = StepPipeline(optimizer=optimizer, adapter=self._scaler, backend=backend, config=config,
                                      device=device)
        ladder = Ladder(config.escalation, on_rollback=on_rollback, on_abort=on_abort) if config.escalation else None
        self._exporter = MultiExporter(exporters)
        self._names: tuple[str, ...] = ()
        self._reporter = rep = _make_reporter(self, ladder)
        self._forensics = Forensics(model=model, config=config, backend=backend, fp16=scaler is not None,
                                    findings=rep.findings)
        self._stage = Stage.READY
        self._step = 0  # step() calls completed = index of the step being prepared
        self._loss = LossMeter()
        self._marks: tuple[Any, ...] | None = None  # the gradients as the last step left them
        self._measured: Any = None  # this step's early measurement (unscale_() before step())
        self._batch_ids: list[Any] = []
        self._loss_hooks: OrderedDict[int, Callable[[torch.Tensor, int], torch.Tensor]] = OrderedDict()
        self._pre_unscale_hooks: OrderedDict[int, Callable[[int], None]] = OrderedDict()
        self._lagged_reports = device.type != "cpu"  # CPU steps are synchronous: report at once
        self._closed = False
        self.backend.attach(self)
        self.run_info = run_info(self)
        self._exporter.open(self.run_info)
        if self._scaler is not None:
            self._scaler.attach(self)
        self._patch_step_function()  # as Optimizer.__init__ does: step pre/post hooks work

    # ------------------------------------------------------------------ Optimizer surface
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # the inner optimizer's own list
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._names = ()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: forward to the inner optimizer (e.g. Horovod's
        # synchronize()). Dunder and private names are not forwarded.
        if name.startswith("_") or name == "optimizer":
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    @property
    def _is_accelerate_prepared(self) -> bool:
        # accelerate's prepare_optimizer() reads this of every optimizer it is given, before it
        # builds anything: there the accelerate integration adopts a guard made before prepare,
        # or refuses it (ampguard.integrations.accelerate.on_prepare).
        if "accelerate" in sys.modules:
            from .integrations.accelerate import on_prepare

            on_prepare(self, sys._getframe(1))
        return False

    def __repr__(self) -> str:
        return f"GuardedOptimizer(precision={self.precision!r}, backend={self.backend.name!r}, {self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("GuardedOptimizer cannot be pickled or deep-copied; save opt.state_dict() and rebuild it "
                        "with ampguard.wrap() + load_state_dict()")

    # ------------------------------------------------------------------ the loop
    def autocast(self, enabled: bool = True) -> torch.autocast:
        """``torch.autocast`` for the guard's device type and precision (disabled for fp32)."""
        return torch.autocast(device_type=self.device.type, dtype=self.dtype,
                              enabled=enabled and self.precision != "fp32")

    def backward(self, loss: torch.Tensor, *, batch_id: Any = None, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (scaled by the loss scale in fp16) and keep it, on device, for
        the step's checks. Call it once per micro-batch; ``kwargs`` go to ``Tensor.backward``.
        ``batch_id`` (any value): recorded into ``opt.quarantine`` if this step goes non-finite,
        so a resumed run can skip the batch. No host sync."""
        self._check_loss("backward", loss)
        if self._stage is Stage.STEPPED and not self._forensics.replaying:
            raise GuardStateError("backward() after step() without zero_grad(): the new gradients would be added to "
                                  "the last step's. Call opt.zero_grad() after opt.step(). Nothing was changed.")
        for hook in self._loss_hooks.values():
            loss = hook(loss, self._step)
        if not self._forensics.replaying:
            self._loss.add(loss, "mean")
            if batch_id is not None:
                self._batch_ids.append(batch_id)
            self._stage = Stage.ACCUMULATING
        else:  # a replay closure's backward: same scale, nothing accumulated
            self._forensics.replay_loss = loss.detach().float().reshape(())
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**kwargs)

    def observe_loss(self, loss: torch.Tensor, *, reduction: Literal["mean", "sum"] = "mean") -> None:
        """Record one micro-batch's loss for this step's checks and report, when the backward is
        run by someone else (a framework). ``reduction="sum"`` where each micro-batch loss was
        already divided by the number of accumulation steps (accelerate, the transformers Trainer):
        the report's loss is then the step's whole loss. No host sync, no backward."""
        self._check_loss("observe_loss", loss, need_grad=False)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r}; allowed: 'mean' | 'sum'")
        if not self._forensics.replaying:
            self._loss.add(loss, reduction)

    def unscale_(self) -> None:
        """Unscale the gradients now (fp16) and measure them, so the caller can clip unscaled
        gradients and the report's ``grad_norm`` is still the norm before clipping. Once per step;
        ``scaler.unscale_(opt)`` does the same. No host sync."""
        self._check_open("unscale_")
        if self._measured is None:
            self._measured = self._measure()

    def step(self, closure: Callable[[], Any] | None = None, *, replay: bool = False) -> Any:  # type: ignore[override]
        """The guarded step: unscale, statistics, one all-gather, decision, inner step or skip,
        scale update, report. Replaces ``scaler.step(opt); scaler.update()``. Returns what
        ``closure`` returned (None without one).

        collective: every rank must call it, once per iteration. Host syncs: see
        :mod:`ampguard.pipeline` (none beyond GradScaler's and the optimizer's own).

        ``closure``: run exactly once, first, with grad enabled (as ``torch.optim`` promises); it
        computes the loss and its gradients. ``replay=True`` (with a closure that zeroes the
        gradients and recomputes the loss of the *same batch*): on a non-finite step the guard runs
        it a second time with forensics hooks armed, at the same loss scale, to name the culprit on
        this step (one host sync to learn the step was non-finite).
        """
        self._check_open("step")
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._check_step_call()
        self._fixed_point()  # the previous step's reports, if they were left pending
        if self._reporter.ladder is not None and self._reporter.ladder.pending_rollback is not None:
            self._rollback_consuming_step()
            return result
        measured = self._measured if self._measured is not None else self._measure()
        pipe = self._pipeline
        gathered = pipe.gather(measured, self._loss.value())
        decision, tracker = pipe.decide(gathered)
        if self._forensics.armed:  # armed only after an anomaly
            self._forensics.collect(self._step, decision, gathered)
        pipe.clip(measured, decision)
        synced = pipe.inner_step(decision, measured)
        pipe.update_scale(decision, tracker)
        if replay and closure is not None and self._forensics.enabled and _nonfinite(decision):  # SYNC
            self._forensics.replay(self._step, closure, scale=self._replay_scale(decision), gathered=gathered,
                                   optimizer=self.optimizer)
        self._reporter.enqueue(self._step, payload(decision, gathered, measured.norms), measured.groups.index,
                               self._batch_ids)
        self._end_step()
        every = self.config.consistency_every
        if every is not None and self.backend.world_size > 1 and self._step % every == 0:
            self._check_consistency()  # collective, on the same step everywhere
        if synced or not self._lagged_reports:
            self._fixed_point()
            if self._reporter.ladder is not None and self._reporter.ladder.pending_rollback is not None:
                self._reporter.ladder.rollback(self, self.model, self.optimizer)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (and any loss kept from a ``backward()`` not followed by ``step()``)."""
        self.backend.zero_grad(self.optimizer, set_to_none)
        self._loss.reset()
        self._measured = None
        self._marks = None if set_to_none else grad_marks(self._pipeline.params())
        self._stage = Stage.READY

    # ------------------------------------------------------------------ extension points
    def register_loss_hook(self, hook: Callable[[torch.Tensor, int], torch.Tensor]) -> RemovableHandle:
        """``hook(loss, step) -> loss`` runs in :meth:`backward` before the loss is kept and
        back-propagated (``ampguard.faults`` uses it). Returns a handle whose ``remove()`` undoes it."""
        handle = RemovableHandle(self._loss_hooks)
        self._loss_hooks[handle.id] = hook
        return handle

    def register_pre_unscale_hook(self, hook: Callable[[int], None]) -> RemovableHandle:
        """``hook(step)`` runs in ``step()`` after the gradients were reduced across ranks and before
        they are unscaled and read. Returns a removable handle."""
        handle = RemovableHandle(self._pre_unscale_hooks)
        self._pre_unscale_hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------------ results (read only: decode, never act)
    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` skipped the inner optimizer. Reading it right after a step
        that did not synchronise (fused optimizer on CUDA) waits for that step's decision."""
        last = self.last_report
        return bool(last and last.skipped)

    @property
    def last_report(self) -> StepReport | None:
        """The last step's :class:`StepReport` (waits for it like ``step_was_skipped``)."""
        self._reporter.decode()
        history = self._reporter.history
        return history[-1] if len(history) else None

    @property
    def history(self) -> History:
        """The last ``config.history_size`` reports; ``history[s]`` is step ``s``'s."""
        self._reporter.decode()
        return self._reporter.history

    @property
    def anomalies(self) -> Sequence[Anomaly]:
        """Anomalies recorded so far, oldest first (the last ``config.max_anomalies``)."""
        self._reporter.decode()
        return tuple(self._reporter.anomalies)

    @property
    def step_count(self) -> int:
        """Number of ``step()`` calls so far (skipped ones included)."""
        return self._step

    @property
    def skipped_steps(self) -> int:
        """Number of skipped steps among the reported ones."""
        self._reporter.decode()
        return self._reporter.skipped_total

    @property
    def quarantine(self) -> list[Any]:
        """``batch_id``s of the micro-batches of non-finite steps (see :meth:`backward`)."""
        return self._reporter.quarantine

    @property
    def param_names(self) -> tuple[str, ...]:
        """Parameter names in ``param_groups`` order: the order of ``StepReport.param_norms``."""
        if not self._names:
            self._names = param_names(self.optimizer, self.model)
        return self._names

    def get_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Synchronises the host."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def flush(self) -> None:
        """Block until every step's report has reached the host and the exporters."""
        self._reporter.decode()
        self._reporter.export_pending()

    def close(self) -> None:
        """Flush, then close the exporters, remove backend hooks and hand the scaler's methods
        back. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._forensics.remove()
            if self._scaler is not None:
                self._scaler.detach()
            self._exporter.close()
            self.backend.close()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer, scaler and every piece of guard state, as plain Python values (plus the
        inner optimizer's tensors). Runs the state-dict hooks registered on this optimizer.
        Synchronises the host (reads device counters)."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        self._reporter.decode()
        state = checkpoint.save(self)
        for post in self._optimizer_state_dict_post_hooks.values():
            state = post(self, state) or state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the run then continues bit for bit. The whole
        dict is checked first: a failed load changes nothing."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre(self, state_dict) or state_dict
        checkpoint.load(self, state_dict)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def _restore_counters(self, step: int, counts: dict[str, int], emas: dict[str, float], quarantine: list[Any],
                          escalation: dict[str, Any] | None) -> None:
        rep, pipe = self._reporter, self._pipeline
        rep.clear_pending()
        rep.history = History(self.config.history_size)
        rep.history._count = step  # reports before the resume are not available
        rep.skipped_total, rep.consecutive_skips = counts["skipped_total"], counts["consecutive_skips"]
        rep.quarantine[:] = quarantine
        self._step = step
        pipe.scale_state.overflow_run.fill_(counts["overflow_run"])
        pipe.spikes.grad_ema.fill_(emas["grad_ema"])
        pipe.spikes.loss_ema.fill_(emas["loss_ema"])
        pipe.spikes.count.fill_(counts["ema_count"])
        if rep.ladder is not None and escalation:
            rep.ladder.load_state_dict(escalation)
        self._stage, self._marks, self._measured = Stage.READY, None, None
        self._loss.reset()

    # ------------------------------------------------------------------ internals
    def _check_open(self, call: str) -> None:
        if self._closed:
            raise GuardStateError(f"{call}() called after close(); wrap the optimizer again to keep training")

    def _check_loss(self, call: str, loss: Any, need_grad: bool = True) -> None:
        self._check_open(call)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"{call}() expects the loss tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(f"{call}() expects a scalar loss, got shape {tuple(loss.shape)}; reduce it first "
                             "(loss.mean() or loss.sum())")
        if need_grad and not loss.requires_grad:
            raise ValueError(f"{call}() got a loss that does not require grad: was it computed under torch.no_grad(), "
                             "or detached?")

    def _check_step_call(self) -> None:
        """Before anything changes: is there a new backward's worth of gradients to step on?"""
        if self._stage is Stage.ACCUMULATING:
            return
        params = self._pipeline.params()
        fresh = (any(p.grad is not None for p in params) if self._marks is None
                 else grad_marks(params) != self._marks)
        if not fresh:
            what = "step()" if self._stage is Stage.STEPPED else "zero_grad()"
            raise GuardStateError(
                f"step() called after {what} with no backward in between: there are no new gradients to step on. "
                "Compute the loss and call opt.backward(loss) (or run your framework's backward) before "
                "opt.step(). Nothing was changed.")
        if self._scaler is not None and not self._scaler.scaled_since_step:
            raise GuardStateError(
                "step() on fp16 gradients that opt.scaler did not scale: call opt.backward(loss), or "
                "opt.scaler.scale(loss).backward() with the scaler the guard shares. Unscaling unscaled gradients "
                "would shrink the update by the loss scale. Nothing was changed.")

    def _measure(self) -> Any:
        self.backend.before_unscale(self.optimizer)
        for hook in tuple(self._pre_unscale_hooks.values()):
            hook(self._step)
        return self._pipeline.measure(self)

    def _fixed_point(self) -> None:
        """Where reports turn into actions, the same step on every rank: export, arm or disarm
        forensics, ladder snapshots and on_abort, and the errors that stop training."""
        rep = self._reporter
        rep.decode()
        rep.export_pending()
        actions = rep.take_actions()
        for report in actions.reports:
            self._forensics.after_report(report)
        if rep.ladder is not None:
            for step in actions.snapshots:
                if self.model is not None:
                    rep.ladder.take_snapshot(self.model, self.optimizer, step)
            if actions.abort is not None and rep.ladder.on_abort is not None:
                rep.ladder.on_abort(self, actions.abort[0])
        if actions.escalation is not None:
            raise actions.escalation

    def _replay_scale(self, decision: torch.Tensor) -> Any:
        from .stats import Dec

        adapter = self._scaler
        return None if adapter is None else (lambda: adapter.at_scale(decision[Dec.SCALE]))

    def _end_step(self) -> None:
        self.backend.reset_pre_reduction()
        self._loss.reset()
        self._batch_ids, self._measured = [], None
        self._step += 1
        self._stage = Stage.STEPPED
        self._marks = grad_marks(self._pipeline.params())
        if self._scaler is not None:
            self._scaler.scaled_since_step = False

    def _rollback_consuming_step(self) -> None:
        """A rollback decided at the start of this step (lagged report): restore, and spend this
        step on it, identically on every rank (no collective runs on this step anywhere)."""
        ladder = self._reporter.ladder
        assert ladder is not None  # internal
        ladder.rollback(self, self.model, self.optimizer)
        self.backend.zero_grad(self.optimizer, True)
        scale = self.get_scale()
        report = StepReport(step=self._step, skipped=True, reason=SkipReason.ROLLBACK, loss=math.nan,
                            loss_scale=scale, next_loss_scale=scale, grad_norm=math.nan, nonfinite_grads=0,
                            nonfinite_loss=False, world_size=self.backend.world_size, rank=self.backend.rank,
                            wall_time=time.time())
        self._reporter.record(report, [], consecutive=False)
        self._reporter.export_pending()
        self._reporter.take_actions()
        self._batch_ids = []
        self._end_step()

    def _check_consistency(self) -> None:
        """Compare step/skip counts, loss scale and a parameter fingerprint across ranks
        (:mod:`ampguard.consistency`). collective; synchronises the host. A mismatch becomes a
        ``rank_divergence`` anomaly on the step just taken, and raises per ``on_divergence``."""
        from .consistency import check

        rep = self._reporter
        div = check(self.backend, step=self._step, skipped=rep.skipped_total,
                    scale=self._scaler.scale if self._scaler is not None else 1.0,
                    params=self._pipeline.params(), device=self.device, compare_params=not self.backend.grads_sharded)
        if div is None:
            return
        rep.divergence = Anomaly(self._step - 1, AnomalyKind.RANK_DIVERGENCE, div.describe(), div.ranks)
        if self.config.on_divergence == "raise":
            rep.decode()
            raise RankDivergenceError(f"step {self._step - 1}: {div.describe()}", div.ranks)


def _nonfinite(decision: torch.Tensor) -> bool:
    from .stats import Dec

    return bool(decision[Dec.LOSS_NONFINITE] + decision[Dec.GRAD_NONFINITE] > 0)


def _make_reporter(guard: GuardedOptimizer, ladder: Ladder | None) -> Any:
    from .reporter import Reporter

    track = guard.device if guard.device.type == "cuda" and guard.config.track_memory else None
    return Reporter(config=guard.config, rank=guard.backend.rank, world_size=guard.backend.world_size,
                    names=lambda: guard.param_names, exporter=guard._exporter, scaled=guard.scaler is not None,
                    ladder=ladder, can_snapshot=guard.model is not None, track_memory=track)
