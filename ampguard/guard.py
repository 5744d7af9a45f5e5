"""GuardedOptimizer: the façade. The Optimizer surface, ``backward``, ``step``, ``zero_grad``,
the readers and the state dict; the work is done by the rooms it delegates to
(:mod:`~ampguard.pipeline` computes a step, :mod:`~ampguard.outcome` settles what it came to,
:mod:`~ampguard.checkpoint`, :mod:`~ampguard.scaling`, :mod:`~ampguard.backends`). Build it with
:func:`ampguard.wrap`.
"""

from __future__ import annotations

import atexit
import enum
import functools
import math
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.optim import optimizer as torch_optimizer
from torch.utils.hooks import RemovableHandle

from . import checkpoint, consistency, integrity
from .backends.base import Backend
from .config import GuardConfig
from .ema import EMA
from .errors import GuardStateError
from .escalation import OnAbort, OnRollback
from .exporters.base import Exporter, MultiExporter
from .fp8 import Fp8Monitor
from .indicators import Indicators
from .integrity import Verdict, amax_per_tensor
from .logs import logger
from .optimizer_view import InnerOptimizerView, param_names
from .outcome import Outcome, Readers
from .pipeline import Measured, StepPipeline, first_ref, grad_marks, marks_after_step, marks_changed
from .records import RunInfo
from .scaling import GradScalerAdapter
from .schedules import ScheduledLR
from .stats import LossMeter
from .vocab import AnomalyKind

if TYPE_CHECKING:
    from .runlog.summary import RunSummary

__all__ = ["GuardedOptimizer", "Stage"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE = operator.attrgetter("dtype")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


_eager = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
"""The loop's calls run eagerly inside a ``torch.compile``d function (``torch.compile(opt.step)``, a compiled
training step that calls ``opt.backward``/``opt.step``, as torch's optimizer-compiling recipe does): Dynamo
breaks the graph at the call and runs the guard's host logic as it is (tracing it failed inside Dynamo).
``torch._disable_dynamo`` is what torch's own ``Optimizer.zero_grad`` and ``state_dict`` carry: it imports
``torch._dynamo`` at the first call, not at ``import ampguard`` (``torch.compiler.disable`` here made the
import take ~1.1 s instead of ~0.1 s). ~1 us a call in eager mode. Two frames more between the caller and
the method (the lazy wrapper and Dynamo's): a warning raised in it counts them in its ``stacklevel``."""


def _let_go(scaler: GradScalerAdapter | None, forensics: Any, backend: Backend, fp8: Fp8Monitor | None,
            exit_flush: Callable[[], None]) -> None:
    """Take off what a guard attached to the user's objects: its finalizer (a guard collected without ``close()``,
    or an ``__init__`` that raised), and ``close()``, which calls it. Each part may already be off."""
    atexit.unregister(exit_flush)
    if scaler is not None:
        scaler.detach()
    forensics.close()
    backend.close()
    if fp8 is not None:
        fp8.close()


def _flush_at_exit(ref: weakref.ref[GuardedOptimizer]) -> None:
    """Interpreter exit with a guard never closed (a script that ends after its loop, ``GuardedTrainer`` users who
    never call ``trainer.guard.close()``): its last reports reach the exporters, as ``close()`` would have sent them.
    Healthy reports wait for a batch (:data:`ampguard.reporter.REPORT_BATCH` steps), and off the CPU a step behind:
    until stop 51 a 21-step run that never closed had 16 steps in its JSONL log. Flushed only (no ``close`` event:
    the run did not end cleanly); a failure is logged, and the exit goes on."""
    guard = ref()
    if guard is None or guard._closed:
        return
    try:
        guard.flush()
    except Exception:
        logger.warning("ampguard: flushing an unclosed guard at exit failed; its last steps may be missing from the "
                       "exporters. Call opt.close() at the end of the run.", exc_info=True)


class Stage(enum.Enum):
    """Where the guard is in one iteration."""

    READY = "ready"  # after zero_grad() (or wrap())
    ACCUMULATING = "accumulating"  # one or more opt.backward() since
    STEPPED = "stepped"  # after step(), until zero_grad()


class GuardedOptimizer(Readers, InnerOptimizerView):
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
                 config: GuardConfig, model: torch.nn.Module | None, exporters: Sequence[Exporter] | Exporter,
                 backend: Backend, device: torch.device, run_info: Callable[[GuardedOptimizer], RunInfo],
                 on_rollback: OnRollback | None = None, on_abort: OnAbort | None = None,
                 fp8: Fp8Monitor | None = None) -> None:
        if config.scale_policy == "headroom" and (scaler is None or not scaler.is_enabled()):
            raise ValueError(f"GuardConfig.scale_policy='headroom' with precision={precision!r} and no enabled "
                             "GradScaler: the headroom policy sets an fp16 loss scale; allowed: precision='fp16' "
                             "(with a GradScaler), or scale_policy='default'. Nothing was changed.")
        super().__init__(optimizer)
        self.precision, self.scaler, self.config = precision, scaler, config
        self.model, self.backend, self.device, self.dtype = model, backend, device, _DTYPES[precision]
        self._scaler = GradScalerAdapter(scaler) if scaler is not None else None
        self._pipeline = StepPipeline(optimizer=optimizer, adapter=self._scaler, backend=backend, config=config,
                                      device=device)
        # leading indicators per top-level module (ampguard.indicators), sampled every N steps
        self._indicators = (Indicators(model, self._pipeline.params(), device)
                            if config.indicators_every is not None and model is not None else None)
        self._names: tuple[str, ...] = ()
        self._outcome = Outcome.build(self, exporter=MultiExporter(exporters), on_rollback=on_rollback,
                                      on_abort=on_abort)
        """Records, forensics, the ladder, the schedules, the voice, the exporters: what each step comes to."""
        out = self._outcome  # the rooms the step calls itself
        self._reporter, self._forensics, self._exporter = out.records, out.forensics, out.exporter
        self._reporter.indicators = self._indicators
        self._fp8 = self._reporter.fp8 = fp8
        """torchao float8 casts measured per module and role (``wrap(fp8=...)``); None: off."""
        self._params_bad: torch.Tensor | None = None
        """Several ranks: the last checked update left this rank's parameters non-finite (a 0-dim device flag),
        for the next step's local vector (``Loc.PARAMS_NONFINITE``)."""
        if fp8 is not None:
            fp8.begin_step(0)
        self._exit_flush = functools.partial(_flush_at_exit, weakref.ref(self))
        """Registered with :mod:`atexit` once the guard is built, unregistered by ``_let_go`` (close() calls it)."""
        self._let_go = weakref.finalize(self, _let_go, self._scaler, self._forensics, backend, fp8, self._exit_flush)
        """What the guard attached to the user's objects (the scaler's methods, the sentinel's and forensics' hooks,
        the backend's hooks, the fp8 monitor's hooks and taps), taken off when a guard dropped without close() is
        collected, or when __init__ raises after attaching some of it. None of these parts holds the guard: a guard
        kept alive by what it attached would never be collected (the scaler adapter holds it weakly)."""
        self._let_go.atexit = False
        self._stage = Stage.READY
        self._step = 0  # step() calls completed = index of the step being prepared
        self._loss = LossMeter()
        self._marks: list[Any] | None = None  # the gradients as the last step left them
        self._first: Any = None  # a weak reference to the first of them (pipeline.marks_changed)
        self._measured: Any = None  # this step's early measurement (unscale_() before step())
        self._loss_hooks: OrderedDict[int, Callable[[torch.Tensor, int], torch.Tensor]] = OrderedDict()
        self._pre_unscale_hooks: OrderedDict[int, Callable[[int], None]] = OrderedDict()
        self._lagged_reports = device.type != "cpu"  # CPU steps are synchronous: report at once
        self._closed = False
        self._loaded: Verdict | None = None  # a loaded state's verdict, its weights checked at the next step
        self._summary: RunSummary | None = None  # close()'s summary, once closed (None if its flush raised)
        try:
            self.backend.attach(self)
            self.run_info = run_info(self)
            self._outcome.exporter.open(self.run_info)
            if self._scaler is not None:
                self._scaler.attach(self)
        except BaseException:
            self._let_go()  # a refused wrap() (the backend's refusal of Adasum, ...) leaves no hook and no patch
            raise
        self._patch_step_function()  # as Optimizer.__init__ does: step pre/post hooks work
        atexit.register(self._exit_flush)

    @staticmethod
    def profile_hook_step(func: Callable[..., Any]) -> Callable[..., Any]:  # type: ignore[override]
        """What ``torch.optim.Optimizer`` wraps every ``step`` in (``_patch_step_function``): the step
        pre/post hooks, global and this optimizer's, inside a profiler range named
        ``Optimizer.step#GuardedOptimizer.step``. Torch's wrapper, taken only when it has something to do:
        a hook registered, or a profiler running (the range is then in its trace); otherwise the step
        itself, without the range's enter and exit (~20 us a step on the 2-core CPU, ``benchmarks/RESULTS.md``,
        "Stop 36"). The inner optimizer's own step keeps its range, as in the plain loop."""
        hooked = torch.optim.Optimizer.profile_hook_step(func)
        hooks = torch_optimizer  # its global hooks: dicts changed in place
        profiling = torch._C._autograd._profiler_enabled

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self = args[0]
            if (profiling() or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                    or hooks._global_optimizer_pre_hooks or hooks._global_optimizer_post_hooks):
                return hooked(*args, **kwargs)
            out = func(*args, **kwargs)
            self._optimizer_step_code()
            return out

        return wrapper

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._names = ()
        if self._indicators is not None:
            self._indicators.remap(self._pipeline.params())

    def __repr__(self) -> str:
        return f"GuardedOptimizer(precision={self.precision!r}, backend={self.backend.name!r}, {self.optimizer!r})"

    # ------------------------------------------------------------------ the loop
    def autocast(self, enabled: bool = True) -> torch.autocast:
        """``torch.autocast`` for the guard's device type and precision (disabled for fp32)."""
        return torch.autocast(device_type=self.device.type, dtype=self.dtype,
                              enabled=enabled and self.precision != "fp32")

    @_eager
    def backward(self, loss: torch.Tensor, *, batch_id: Any = None, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (scaled by the loss scale in fp16) and keep it, on device, for
        the step's checks. Call it once per micro-batch; ``kwargs`` go to ``Tensor.backward``.
        ``batch_id`` (any value): recorded into ``opt.quarantine`` if this step goes non-finite,
        so a resumed run can skip the batch. No host sync."""
        self._check_loss("backward", loss)
        replaying = self._forensics.replaying
        cleared = None  # gradients another zero_grad() cleared since step(): the guard's own zero_grad() is implied
        if self._stage is Stage.STEPPED and not replaying:
            cleared = self._cleared_elsewhere()
            if cleared is None:
                raise GuardStateError(
                    "backward() after step() without zero_grad(): the new gradients would be added to the last step's. "
                    "Call opt.zero_grad() (or model.zero_grad()) after opt.step(). Nothing was changed.")
        if not replaying:
            self._loss.check("mean")  # before anything runs: a refused call changes nothing
        for hook in self._loss_hooks.values():
            loss = hook(loss, self._step)
        scaled_before = self._scaler is not None and self._scaler.scaled_since_step
        kept = self._loss.kept(loss)  # before the backward, which leaves every cache cold (benchmarks/RESULTS.md)
        try:
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**kwargs)
        except BaseException:
            # A backward that raised (a freed graph, an in-place modification) leaves the guard as it
            # was: its loss is not kept, the step's stage does not move, the scaler's mark is undone.
            if self._scaler is not None:
                self._scaler.scaled_since_step = scaled_before
            raise
        if replaying:  # a replay closure's backward: same scale, nothing accumulated
            self._forensics.replay_loss = kept
            return
        if cleared is not None:  # as opt.zero_grad() would leave them; set once the backward ran
            self._marks, self._first = cleared
        self._loss.add(loss, "mean", kept)
        if batch_id is not None:
            self._outcome.batch_ids.append(batch_id)
        self._stage = Stage.ACCUMULATING
        voice = self._outcome.voice
        if not voice.dtype_checked:  # the first loss only
            voice.check_activation_dtype(loss, self.device.type, self.dtype, self._step, stacklevel=4)

    @_eager
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
            voice = self._outcome.voice
            if not voice.dtype_checked:  # the first loss only
                voice.check_activation_dtype(loss, self.device.type, self.dtype, self._step, stacklevel=4)

    @_eager
    def unscale_(self) -> None:
        """Unscale the gradients now (fp16) and measure them, so the caller can clip unscaled
        gradients and the report's ``grad_norm`` is still the norm before clipping. Once per step;
        ``scaler.unscale_(opt)`` does the same. No host sync."""
        self._check_open("unscale_")
        if self._measured is None:
            self._measured = self._measure()

    @_eager
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        parameters: Iterable[torch.Tensor] | torch.Tensor | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for this step's gradients (``parameters``: None, the
        guarded ones): returns the total norm of the unscaled gradients before clipping, a device
        tensor (no host sync). On the fused fast path, the first call of a step with ``norm_type=2``
        over the guarded parameters (and no ``GuardConfig.clip_grad_norm``/``zclip``) is *folded*:
        the norm is the guard's own measurement of the still-scaled gradients, and the coefficient
        ``min(1, max_norm / (norm + 1e-6))`` goes into the fused optimizer's ``grad_scale``: no pass
        over the gradients here. Otherwise (and on a second call in the step, which first applies the
        folded clip) it unscales (:meth:`unscale_`) and calls torch's ``clip_grad_norm_``, as the
        plain loop does. The report's ``clip_coef`` is the first call's coefficient. ``max_norm=inf``
        is torch's norm with no clip (transformers 5 asks for it every step to log the norm, with
        ``max_grad_norm=0``): folded, it is the measurement alone, and the coefficient stays 1."""
        self._check_open("clip_grad_norm_")
        max_norm = _clip_max_norm(max_norm)
        params = self._pipeline.params()
        if parameters is None:  # the guarded ones: the same set when every one of them requires grad
            chosen, same = params, all(map(_REQUIRES_GRAD, params))
        else:  # the guarded parameters, frozen ones aside (their gradient is None: torch's clip skips them too)
            chosen = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            same = {id(p) for p in chosen if p.requires_grad} == self._pipeline.param_ids()
        reported = (same and float(norm_type) == 2.0 and self.config.clip_grad_norm is None
                    and self.config.zclip is None)  # the report's clip_coef is this clip's
        foldable = reported and self._pipeline.fused  # a non-fused optimizer: torch's clip, its values
        clips = math.isfinite(max_norm)  # inf: torch's norm with no clip (what transformers 5 logs every step)
        measured = self._measured
        if measured is None and foldable:
            measured = self._measured = self._measure(fast=True)
            if measured.scaled:
                if clips:
                    measured.clip_norm = max_norm
                return torch.linalg.vector_norm(measured.norms, 2.0)
        elif measured is not None and measured.scaled:  # a second call: apply the folded clip first
            first = self._pipeline.measure(self)  # GradScaler's unscale_, as the plain loop's
            folded = measured.clip_norm
            first.numerics, first.clip_norm, first.clip_applied = measured.numerics, folded, folded is not None
            self._measured = first
            if folded is not None:
                torch.nn.utils.clip_grad_norm_(params, folded)
            reported = False
        self.unscale_()
        total = torch.nn.utils.clip_grad_norm_(chosen, max_norm, norm_type)
        measured = self._measured
        if reported and clips and measured.clip_norm is None:  # the report's clip_coef: this clip's
            measured.clip_norm, measured.clip_applied = max_norm, True
        return total

    @_eager
    def step(self, closure: Callable[[], Any] | None = None, *, replay: bool = False) -> Any:  # type: ignore[override]
        """The guarded step: unscale, statistics, one all-gather, decision, inner step or skip,
        scale update, report. Replaces ``scaler.step(opt); scaler.update()``. Returns what
        ``closure`` returned (None without one).

        collective: every rank must call it, once per iteration. Host syncs: see
        :mod:`ampguard.pipeline` (none beyond GradScaler's and the optimizer's own).

        With a GradScaler and a fused optimizer (the fused fast path)
        the gradients are measured still scaled and the optimizer's kernel unscales and clips them
        as it updates; ``.grad`` is then left as the plain fused GradScaler loop leaves it: unscaled
        (and clipped) on a step taken, still scaled on a skipped one. After :meth:`unscale_` (or
        ``scaler.unscale_(opt)``) this step unscales first, as without the fast path.

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
        fresh = self._fresh_grads()
        self._check_step_call(fresh)
        if self._loaded is not None:  # the first step after a load: its weights must be the saved ones
            loaded, self._loaded = self._loaded, None
            integrity.check_weights(loaded, self._named_params())
        if not self._loss.count:  # a host int: the loss the guard never saw (no sync)
            self._outcome.voice.no_loss(self._step, stacklevel=5)  # 5: inside _eager's two and torch's step wrapper
        # the reports left pending, up to the report lag (this forward is done); a rollback spends this step
        if self._outcome.settle(next_forward=self._step + 1, before=self._step + 1 - self._report_lag()):
            return result
        pipe = self._pipeline
        sentinel = self._forensics.sentinel
        fp8 = fp8_bad = None
        if self._fp8 is not None:  # this step's fp8 casts, and whether one was non-finite: on device
            fp8 = self._fp8.collect()
            fp8_bad = self._fp8.nonfinite(fp8)
        if sentinel is not None:  # the next forward may read the model's output through the loss (a host bool)
            sentinel.loss_given = self._loss.count > 0
        flagged = sentinel.value() if sentinel is not None else None  # once: reading it clears it for the next step
        measured = self._measured
        if measured is None:  # a local vector of the loss, the measurement and the flags: on to the decision
            plain = fresh and self._params_bad is None
            measured = self._measure(fast=True, decide=plain, fp8=fp8_bad, sentinel=flagged)
        if measured.decided is not None:  # measured, gathered and decided in one replay (StepPipeline.measure)
            gathered, decided = measured.gathered, measured.decided
        elif measured.gathered is not None:  # measured and gathered in one replay; the host decision next
            gathered = measured.gathered
            decided = pipe.decide(gathered, measured)
        else:
            gathered = pipe.gather(measured, self._loss.value(), no_grads=not fresh,
                                   sentinel=flagged, fp8=fp8_bad,
                                   params_bad=self._params_bad)
            decided = pipe.decide(gathered, measured)  # the decision, and the path it was taken on
        self._params_bad = None
        decision = decided.vector
        if self._forensics.armed:  # armed only after an anomaly
            self._forensics.collect(self._step, decision, gathered)
        # a device decision: its skip flag copied ahead of the inner step, when read every step (Reporter.early_skip)
        early = self._reporter.copy_skip(self._step, decision) if decided.skipped is None else None
        pipe.clip(measured, decided)
        ind = self._indicators  # a sampled step copies the weights before the inner step
        every = self.config.indicators_every
        sample = (ind.before_step(measured, pipe.params())
                  if ind is not None and every is not None and self._step % every == 0 else None)
        settles = pipe.inner_step(decided, measured)  # whether its report may be decoded at this step's end
        tail = ind.after_step(sample) if sample is not None else None  # type: ignore[union-attr]
        if self._outcome.schedules.emas:  # on device: torch.where on the skip flag (a host bool on CPU)
            self._outcome.schedules.update_emas(decision, decided.skipped)
        pipe.update_scale(decided)
        if replay and closure is not None:  # a non-finite step only (one SYNC to learn it)
            self._forensics.replay_if_nonfinite(self._step, closure, decision, gathered, self.optimizer, self._scaler)
        check = self.config.param_check_every  # the updated parameters' max|p|, on device, in the report
        params = self._param_amax() if check is not None and self._step % check == 0 else None
        if params is not None and self.backend.world_size > 1:  # every rank learns it in the next step's gather
            self._params_bad = (~torch.isfinite(params)).any().float()
        self._reporter.enqueue(self._step, pipe.payload(decided, gathered, measured, tail, params, fp8),
                               measured.groups.index, self._outcome.batch_ids, decided.skipped, early)
        self._end_step(measured)
        every = self.config.consistency_every
        if every is not None and self.backend.world_size > 1 and self._step % every == 0:  # collective
            consistency.check_outcome(self._outcome, self._step, self._scaler, pipe.params(), self.device, self.config)
        if settles or not self._lagged_reports:
            self._outcome.settle(next_forward=self._step)  # after _end_step: the next forward is this step's
        elif decided.skipped is not None:  # its skip read by its step (a non-fused optimizer): no guess to undo
            self._outcome.schedules.step_known(self._step - 1, decided.skipped)
        else:  # its outcome learnt later: the schedulers advance now as if it was taken, undone if it was not
            self._outcome.schedules.step_ahead(self._step - 1)
        return result

    @_eager
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (and any loss kept from a ``backward()`` not followed by ``step()``)."""
        self.backend.zero_grad(self.optimizer, set_to_none)
        self._loss.reset()
        self._measured = None
        params = self._pipeline.params()
        self._marks, self._first = (None, None) if set_to_none else (grad_marks(params), first_ref(params))
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

    # ------------------------------------------------------------------ skip-aware schedules and EMA
    def schedule(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> ScheduledLR:
        """Hand ``scheduler`` to the guard: it is stepped once per *taken* optimizer step (a
        skipped step holds the LR), with no host sync. Returns a :class:`~ampguard.schedules.ScheduledLR`
        to keep in its place: its ``step()`` raises :class:`GuardStateError` (``close()`` gives
        it back), everything else is the scheduler's. Do not call the scheduler's own ``step()``.

        When: right after the step where the step synchronised or decided on the host (CPU,
        non-fused optimizers on CUDA); on the sync-free path (fused optimizer on CUDA) ahead, at the
        end of ``step()`` as if the step was taken, kept or undone (a skipped step) at the start of
        the next ``step()``, before its inner update reads the LR, so every update uses the LR of a
        loop that syncs each step. The last step's outcome is counted at ``flush()``,
        ``state_dict()``, ``close()``, the returned wrapper's ``state_dict()`` or (reading its skip
        flag only) ``get_last_lr()``. Registering waits for the pending reports once. See
        ``docs/schedules.md``."""
        self._check_open("schedule")
        return self._outcome.schedules.add_scheduler(self.optimizer, scheduler)

    def track_ema(self, ema: EMA) -> EMA:
        """Update ``ema`` (:class:`ampguard.EMA`) inside each ``step()``, right after the inner
        step, only when the step is taken: gated on device by the skip flag, no host sync.
        Returns it."""
        self._check_open("track_ema")
        self._outcome.schedules.add_ema(self.optimizer, ema)
        return ema

    # ------------------------------------------------------------------ results (read only: see outcome.Readers)
    @property
    def step_count(self) -> int:
        """Steps so far: ``step()`` calls, skipped ones included, and rollbacks (a rollback is a step
        of its own, see :mod:`ampguard.outcome`). The next ``step()`` is step ``step_count``."""
        return self._step

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
        """Block until every step's report has reached the host and the exporters, and the
        exporters have written it (the JSONL log's background writer drained)."""
        self._outcome.flush()

    def summary(self) -> Any:
        """The run so far as ``ampguard report`` summarises its event log: an
        :class:`ampguard.runlog.RunSummary` (steps, skips by reason, loss-scale range, where
        non-finite values came from, anomalies by kind; ``.to_dict()`` for JSON,
        ``ampguard.runlog.format_summary`` for the table), from this rank's reports. Waits for the
        pending reports (like :meth:`flush`), and logs the table at INFO on the ``ampguard`` logger.
        After :meth:`close`, the summary ``close()`` returned."""
        if self._closed:
            return self._summary
        self.flush()
        return self._outcome.summary(self.run_info, self._step, closed=False)

    def close(self) -> Any:
        """Flush, then close the exporters, remove backend hooks and hand the scaler's methods
        back. Returns the run's summary (:meth:`summary`) and logs it at INFO. Idempotent: a second
        call returns the same summary."""
        if self._closed:
            return self._summary
        try:
            self.flush()
        finally:
            self._closed = True
            self._let_go()  # the scaler's methods; forensics', the backend's, the fp8 monitor's hooks; the exit flush
            self._outcome.close()  # the schedulers handed back, the exporters closed
        self._summary = self._outcome.summary(self.run_info, self._step, closed=True)
        return self._summary

    # ------------------------------------------------------------------ state
    def verify(self) -> Verdict:
        """The health of the training state now (:class:`~ampguard.integrity.Verdict`): whether the
        last step was finite, which parameters and optimizer state tensors hold a NaN/Inf (by name),
        and each parameter's bitwise fingerprint. Check it before saving a checkpoint with
        ``torch.save`` or ``torch.distributed.checkpoint``: ``state_dict()`` carries the same verdict
        and ``load_state_dict()`` refuses an unhealthy one. One pass over the parameters and the
        optimizer state on device, then a host read (a sync). This rank's state; also after
        :meth:`close`. With ``torch.distributed.checkpoint``, save through :mod:`ampguard.integrations.dcp`
        (torch's ``get_state_dict`` cannot take the guard). See docs/integrity.md."""
        return self._verdict()

    def _verdict(self, fingerprints: bool = True) -> Verdict:
        """:meth:`verify`; ``fingerprints=False``: health only (the integrations' refusal to save,
        before the framework's own ``state_dict()`` call takes the full verdict)."""
        self._outcome.catch_up()
        rep = self._outcome.records
        last = rep.history[-1] if len(rep.history) else None
        bad_update = any(a.kind == AnomalyKind.NONFINITE_PARAMS and last is not None and a.step == last.step
                         for a in rep.anomalies)
        finite = last is None or not (last.nonfinite or bad_update)
        return integrity.verify(self._named_params(), self.optimizer, step=self._step, last_step_finite=finite,
                                fingerprints=fingerprints)

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer, scaler and every piece of guard state, as plain Python values (plus the
        inner optimizer's tensors), with the state's health (:meth:`verify`, under
        ``["ampguard"]["verdict"]``). Runs the state-dict hooks registered on this optimizer.
        Synchronises the host (reads device counters). Every pending report is counted first, so a
        registered scheduler's advance made ahead (:meth:`schedule`) is kept or undone: the scheduler's own
        state_dict is then exact."""
        self._outcome.catch_up()
        return self._with_state_dict_hooks(lambda _: self._saved())

    def _saved(self, optimizer: bool = True) -> dict[str, Any]:
        """:func:`ampguard.checkpoint.save` with the verdict (:meth:`verify`) under ``["ampguard"]["verdict"]``;
        ``optimizer=False``: without the inner optimizer (``"optimizer"`` None)."""
        state = checkpoint.save(self, self._outcome.records, self._pipeline, optimizer=optimizer)
        state["ampguard"]["verdict"] = self.verify().to_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the run then continues bit for bit. The whole
        dict is checked first: a failed load changes nothing. Registered schedulers and EMAs
        are not in it: load their own state dicts."""
        self._with_load_state_dict_hooks(self._load, state_dict)
        self._outcome.schedules.resync()

    def _load(self, _: GuardedOptimizer, state_dict: dict[str, Any]) -> None:
        """Restore, then at the restored step, ready for the next backward."""
        self._resume(checkpoint.load(self, self._outcome.records, self._pipeline, state_dict))

    def _resume(self, loaded: tuple[int, Verdict | None]) -> None:
        self._step, self._loaded = loaded
        self._stage, self._marks, self._measured, self._outcome.batch_ids = Stage.READY, None, None, []
        self._first = None
        self._loss.reset()

    def _state_without_optimizer(self) -> dict[str, Any]:
        """:meth:`state_dict` with ``"optimizer"`` None: the scaler and the guard's state, with the
        verdict, for a checkpoint that saves the inner optimizer its own way (:mod:`ampguard.integrations.dcp`)."""
        self._outcome.catch_up()
        return self._saved(optimizer=False)

    def _check_without_optimizer(self, state_dict: Any, optimizer_state: Any) -> Callable[[], None]:
        """Check what :meth:`_state_without_optimizer` saved, against ``optimizer_state`` (the inner
        optimizer's state as it will be loaded: refused if it holds a NaN/Inf); a refusal raises and
        changes nothing. Returns the call that restores it (it cannot fail), after which the guard
        is at the restored step as after :meth:`load_state_dict`."""
        self._check_open("load_state_dict")
        apply = checkpoint.check(self, self._outcome.records, self._pipeline, state_dict,
                                 optimizer_state=optimizer_state)

        def restore() -> None:
            self._resume(apply())
            self._outcome.schedules.resync()

        return restore

    # ------------------------------------------------------------------ internals
    def _named_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(zip(self.param_names, self._pipeline.params()))

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

    def _fresh_grads(self) -> bool:
        """Whether a backward since the last step/zero_grad reached any parameter (version counters
        of the gradients, no sync; it stops at the first gradient a backward reached)."""
        params = self._pipeline.params()
        if self._marks is None:
            return any(p.grad is not None for p in params)
        return marks_changed(params, self._marks, self._first)

    def _cleared_elsewhere(self) -> tuple[list[Any] | None, Any] | None:
        """After step(), before the guard's own zero_grad(): were the gradients the step left all cleared
        by another one (``model.zero_grad()``, the inner optimizer's, ``p.grad = None``)? Each is None now,
        another tensor, or written since (``zero_()`` moves its version counter); a gradient left as the
        step left it would have the next backward added to it. Returns ``(marks, first)``, the marks
        ``opt.zero_grad()`` would have left (None: every gradient is None) and :func:`first_ref` of them, or None
        when some gradient is still the step's. One attribute read per parameter, no sync."""
        params = self._pipeline.params()
        if all(p.grad is None for p in params):  # set_to_none, the default of every zero_grad: nothing to compare
            return None, None
        now = grad_marks(params)
        before = self._marks if self._marks is not None else [None] * len(now)
        if any(b is not None and n == b for n, b in zip(now, before)):
            return None
        return (None, None) if all(n is None for n in now) else (now, first_ref(params))

    def _check_step_call(self, fresh: bool) -> None:
        """Before anything changes: is there a new backward's worth of gradients to step on? A
        backward that ran (``opt.backward``, or a loss given to ``observe_loss``) but reached no
        parameter is not a call-order error: that step is skipped, on every rank, with an anomaly."""
        if self._stage is Stage.ACCUMULATING or (not fresh and self._loss.count):
            return
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

    def _measure(self, fast: bool = False, decide: bool = False, fp8: torch.Tensor | None = None,
                 sentinel: torch.Tensor | None = None) -> Any:
        """``fast``: from ``step()``, the fused fast path may measure the gradients still scaled
        (never from ``unscale_()``, whose caller wants them unscaled). ``decide``: from ``step()``, and it may go
        on to the local vector and the decision (:meth:`StepPipeline.measure`), with ``fp8``, the fp8 monitor's
        non-finite flag, and ``sentinel``, the sentinel's value, in the vector."""
        self.backend.before_unscale(self.optimizer)
        for hook in tuple(self._pre_unscale_hooks.values()):
            hook(self._step)
        pipe = self._pipeline  # numerics_every: an int compare
        return pipe.measure(self, fast=fast, sample=pipe.numerics.sampled(self._step), decide=decide,
                            loss=self._loss.value() if decide else None, fp8=fp8, sentinel=sentinel)

    def _param_amax(self) -> torch.Tensor:
        """The parameter check's max|p| of every parameter, on device: off the CPU one replay of the captured
        kernels where :meth:`StepPipeline.params_graphable` (eagerly: a ``_foreach_norm`` output a parameter, ~1 ms
        of host for GPT-2 350M's 292 on the H200's host). The graph's output is rewritten by its next replay: the
        payload's ``cat`` and the flag below copy it within the step."""
        pipe = self._pipeline
        params = pipe.params()
        if not pipe.params_graphable():
            return amax_per_tensor(params)
        return pipe.param_graph.run(("parameter amax", *map(_DTYPE, params)),  # type: ignore[no-any-return]
                                    lambda: amax_per_tensor(params), params)

    def _report_lag(self) -> int:
        """How many steps behind ``step()`` decodes a sync-free step's report: 2 (the host may run
        two steps ahead of the device: no step waits on the previous step's copy), or 1 where the
        next update needs the previous step's outcome first: a registered scheduler (the LR it reads
        is held on a skipped step) or the ladder (a snapshot must hold the state of the step it names).
        The same on every rank (it depends on the configuration and the registrations only)."""
        out = self._outcome
        return 1 if out.schedules.schedulers or out.ladder is not None else 2

    def _end_step(self, measured: Measured | None = None) -> None:
        """``measured``: the step's measurement, whose grouping names the gradients the step left
        (their marks without a ``.grad`` read per parameter); None: read them (a rollback)."""
        self.backend.reset_pre_reduction()
        self._loss.reset()
        self._outcome.batch_ids, self._measured = [], None
        self._step += 1
        self._stage = Stage.STEPPED
        params = self._pipeline.params()
        self._marks = grad_marks(params) if measured is None else marks_after_step(measured.groups, params)
        self._first = first_ref(params)
        if self._scaler is not None:
            self._scaler.scaled_since_step = False
        if self._fp8 is not None:  # the next forward's casts are the next step's
            self._fp8.begin_step(self._step)


def _clip_max_norm(max_norm: Any) -> float:
    """``clip_grad_norm_``'s ``max_norm`` as a float; a clear error for anything but a number > 0 (``inf``, as in
    torch: the norm, and no clip)."""
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1:
        max_norm = max_norm.item()
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"clip_grad_norm_(max_norm={max_norm!r}): expects a number, e.g. max_norm=1.0")
    if not max_norm > 0:  # NaN fails too
        raise ValueError(f"clip_grad_norm_(max_norm={max_norm!r}): allowed: a number > 0 (e.g. 1.0; inf: the norm "
                         "and no clip, as torch's); to not clip, do not call it. Nothing was changed.")
    return float(max_norm)
