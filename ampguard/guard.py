"""GuardedOptimizer and wrap(): the guarded step.

One step, and where the host waits for the device (the only places it does):

1. ``backend.before_unscale``  Horovod: ``synchronize()`` (its own wait on the all-reduce).
2. ``scaler.unscale_(inner)``  GradScaler's fused unscale + non-finite check. No sync.
3. per-tensor norms           one ``torch._foreach_norm`` per (device, dtype) group. No sync.
4. all-gather                 one collective of ``LOCAL_K`` floats per rank. NCCL: no host sync
                              (the stream waits); gloo/CPU: blocking, as every CPU op is.
5. decide                     tensor ops on device (:func:`ampguard.policies.decide`). No sync.
6. clip                       ``_foreach_mul_`` by the decided coefficient. No sync.
7. inner step or skip         the skip is folded into GradScaler's ``found_inf``:
                              - fused optimizers (``_step_supports_amp_scaling``) read it on
                                device: no sync;
                              - other optimizers: GradScaler's own ``found_inf.item()`` (fp16), or
                                the guard's one ``.item()`` on the skip flag (bf16/fp32): the one
                                sync a skipping step needs, and the one GradScaler already makes.
8. scale update               ``GradScaler.update(new_scale=tensor)``. No sync.
9. report                     decision + gathered matrix + per-tensor norms copied with one
                              ``non_blocking`` copy to pinned memory. Read on the host at once when
                              step 7 synchronised, else at the start of the next ``step()`` (an
                              event wait on work already finished, not a device drain).
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
import uuid
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .config import GuardConfig
from .errors import GuardStateError, NonFiniteError, RankDivergenceError
from .escalation import Ladder
from .exporters.base import Exporter, MultiExporter
from .forensics import Finding, Localizer
from .hardware import check_precision
from .policies import ScalerView, SpikeState, decide
from .report import Anomaly, History, RunInfo, StepReport
from .scaling import ScaleState
from .stats import DECISION_K, LOCAL_K, REASONS, Dec, Loc, grads_by_device_and_dtype, local_vector, per_tensor_norms
from .vocab import AnomalyKind, Cause, Phase, SkipReason

__all__ = ["GuardedOptimizer", "wrap"]

_PRECISIONS = ("auto", "fp16", "bf16", "fp32")
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_STATE_VERSION = 1
# GradScaler's per-optimizer stages (torch.amp.grad_scaler.OptState), compared by name so a
# torch that moves the enum keeps working.
_READY, _UNSCALED = "READY", "UNSCALED"


class _Pending:
    __slots__ = ("buf", "event", "memory", "step")

    def __init__(self, step: int, buf: torch.Tensor, event: Any, memory: tuple[int, int] | None) -> None:
        self.step, self.buf, self.event, self.memory = step, buf, event, memory


class GuardedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that guards each step of the optimizer it wraps.

    Build it with :func:`wrap`. ``param_groups``, ``state`` and ``defaults`` are the inner
    optimizer's own objects, so LR schedulers, ``isinstance`` checks and code that edits
    ``param_groups[i]["lr"]`` work unchanged.

    Call order per iteration: ``backward(loss)`` (one or more times, for accumulation), then
    ``step()``, then ``zero_grad()``. Anything else raises :class:`GuardStateError` naming the
    call to make instead, before touching model, optimizer or scaler.
    """

    # Declared so that a habitual ``scaler.step(opt)`` takes GradScaler's fused-optimizer path,
    # which only multiplies the gradients by 1.0 before calling ``step()``: there the guard
    # recognises the call and refuses it with nothing changed (see _check_step_call).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        precision: str,
        scaler: torch.amp.GradScaler | None,
        config: GuardConfig,
        model: torch.nn.Module | None,
        exporters: Sequence[Exporter],
        backend: Any,
        device: torch.device,
        on_rollback: Callable[[Any, int], None] | None = None,
        on_abort: Callable[[Any, str], None] | None = None,
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: it would build param_groups of its own.
        # These are the attributes its methods (hooks, profiling, repr) rely on.
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self.optimizer = optimizer
        self.precision = precision
        self.scaler = scaler
        self.config = config
        self.model = model
        self.backend = backend
        self.device = device
        self.dtype = _DTYPES[precision]
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._exporter = MultiExporter(exporters)
        self._names = _param_names(optimizer, model)

        self._stage = "ready"  # ready -> backward -> stepped -> (zero_grad) ready
        self._step = 0  # step() calls completed = index of the step being prepared
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._pending: deque[_Pending] = deque()
        self._spikes = SpikeState.fresh(device)
        self._scale_state = ScaleState.fresh(device)
        self._skipped_total = 0
        self._consecutive_skips = 0
        self._escalation: Exception | None = None
        self._history = History(config.history_size)
        self._anomalies: deque[Anomaly] = deque(maxlen=config.max_anomalies)
        self._closed = False
        self._divergence: Anomaly | None = None  # a consistency check's finding, until reported
        self._graph: tuple[Any, Any, torch.Tensor, Any] | None = None  # CUDA graph of the decision
        self._graph_failed = False
        self._decided_eagerly = False
        # Forensics: no hook until a non-finite step; findings wait for their step's report.
        self._localizer: Localizer | None = None
        self._armed_clean = 0
        self._findings: dict[int, Finding] = {}
        self._replaying = False
        self._replay_loss: torch.Tensor | None = None
        # Escalation ladder (None: skip and back off only) and the quarantine of batch ids.
        self._ladder = (
            Ladder(config.escalation, on_rollback=on_rollback, on_abort=on_abort)
            if config.escalation is not None
            else None
        )
        self.quarantine: list[Any] = []
        self._batch_ids: list[Any] = []
        self._step_batch_ids: dict[int, list[Any]] = {}
        # Extension points used by ampguard.faults (and the forensics module): callables run
        # in backward() on the loss, and in step() after gradient synchronisation.
        self._loss_transforms: list[Callable[[torch.Tensor, int], torch.Tensor]] = []
        self._pre_unscale_callbacks: list[Callable[[int], None]] = []

        self.backend.attach(self)
        run_id = os.environ.get("AMPGUARD_RUN_ID") or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        run_id = self.backend.broadcast_object(run_id, 0)  # collective: same id on every rank
        self.run_info = RunInfo(
            run_id=str(run_id),
            rank=backend.rank,
            local_rank=backend.local_rank,
            world_size=backend.world_size,
            precision=precision,
            backend=backend.name,
            device=str(device),
            param_names=tuple(self._names.values()),
            versions=(
                ("ampguard", _version()),
                ("torch", torch.__version__),
                ("python", platform.python_version()),
            ),
        )
        self._exporter.open(self.run_info)
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
        self._names = _param_names(self.optimizer, self.model)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: forward to the inner optimizer (e.g. Horovod's
        # synchronize()). Dunder and private names are not forwarded.
        if name.startswith("_") or name == "optimizer":
            raise AttributeError(name)
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"GuardedOptimizer(precision={self.precision!r}, backend={self.backend.name!r}, {self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "GuardedOptimizer cannot be pickled or deep-copied; save opt.state_dict() and rebuild it "
            "with ampguard.wrap() + load_state_dict()"
        )

    # ------------------------------------------------------------------ the loop
    def autocast(self, enabled: bool = True) -> torch.autocast:
        """``torch.autocast`` for the guard's device type and precision (disabled for fp32)."""
        return torch.autocast(
            device_type=self.device.type, dtype=self.dtype, enabled=enabled and self.precision != "fp32"
        )

    def backward(self, loss: torch.Tensor, *, batch_id: Any = None, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (scaled by the loss scale in fp16) and keep it, on device, for
        the step's checks. Call it once per micro-batch; ``kwargs`` go to ``Tensor.backward``.
        ``batch_id`` (any value): recorded into ``opt.quarantine`` if this step goes non-finite,
        so a resumed run can skip the batch. No host sync."""
        self._check_open("backward")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward() expects the loss tensor, got {type(loss).__name__}")
        if loss.numel() != 1:
            raise ValueError(
                f"backward() expects a scalar loss, got shape {tuple(loss.shape)}; reduce it first "
                "(loss.mean() or loss.sum())"
            )
        if not loss.requires_grad:
            raise ValueError(
                "backward() got a loss that does not require grad: was it computed under torch.no_grad(), "
                "or detached?"
            )
        for transform in self._loss_transforms:
            loss = transform(loss, self._step)
        if self._replaying:  # a replay closure's backward: same scale, nothing accumulated
            self._replay_loss = loss.detach().float().reshape(())
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**kwargs)
            return
        if batch_id is not None:
            self._batch_ids.append(batch_id)
        detached = loss.detach().float().reshape(())
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._loss_count += 1
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)
        self._stage = "backward"

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """The guarded step: unscale, statistics, one all-gather, decision, inner step or skip,
        scale update, report. Replaces ``scaler.step(opt); scaler.update()``.

        collective: every rank must call it, once per iteration. Host syncs: see the module
        docstring (none beyond GradScaler's and the optimizer's own).

        ``closure`` (optional, as for ``torch.optim.LBFGS``): a function that zeroes the gradients,
        recomputes the loss of the *same batch* and calls ``opt.backward(loss)``. If no
        ``backward()`` preceded this call, it is called first to produce the gradients. On a
        non-finite step the guard replays it with forensics hooks armed, at the same loss scale,
        to name the culprit on this step (one host sync to learn the step was non-finite).
        """
        if closure is not None and self._stage != "backward":
            self._check_open("step")
            with torch.enable_grad():
                closure()
        self._check_step_call()
        self._materialize()  # the previous step's report, if it was left pending
        self._raise_escalation()
        if self._ladder is not None and self._ladder.pending_rollback is not None:
            self._rollback_consuming_step()
            return
        inner = self.optimizer
        self.backend.before_unscale(inner)
        for callback in self._pre_unscale_callbacks:
            callback(self._step)

        params = list(_params(inner))
        found_inf_per_device: dict[torch.device, torch.Tensor] = {}
        scale = None
        scaler_view = None
        if self.scaler is not None:
            found_inf_per_device = self._unscale()
            scale = self.scaler._scale
            scaler_view = ScalerView(
                scale=scale,  # type: ignore[arg-type]
                growth_tracker=self.scaler._growth_tracker,  # type: ignore[arg-type]
                growth_factor=self.scaler.get_growth_factor(),
                backoff_factor=self.scaler.get_backoff_factor(),
                growth_interval=self.scaler.get_growth_interval(),
            )
        found_inf = None
        if len(found_inf_per_device) == 1:
            (found_inf,) = found_inf_per_device.values()
        elif found_inf_per_device:
            found_inf = torch.stack(
                [t.to(self.device, non_blocking=True).reshape(()) for t in found_inf_per_device.values()]
            ).sum()

        groups = grads_by_device_and_dtype(params)
        norms = per_tensor_norms(groups, self.device)
        vec, _ = local_vector(
            loss_sum=self._loss_sum,
            loss_count=self._loss_count,
            tensor_norms=norms,
            found_inf=found_inf,  # type: ignore[arg-type]
            pre_reduction=self.backend.pre_reduction_flags(),
            scale=scale,
            device=self.device,
        )
        gathered = self.backend.all_gather(vec).wait()
        decision, tracker = self._decide(gathered, scaler_view)
        skip = decision[Dec.SKIP]
        if self._localizer is not None and self._localizer.armed:  # armed only after an anomaly
            self._collect_finding(decision, gathered)  # before clipping multiplies an inf by 0
        if self.config.clip_grad_norm is not None:
            coef = decision[Dec.CLIP_COEF]
            for grads in groups.values():
                torch._foreach_mul_(grads, coef.to(grads[0].device))
        synced = self._inner_step(skip, found_inf_per_device)
        if self.scaler is not None:
            self.scaler.update(new_scale=decision[Dec.NEXT_SCALE])
            self.scaler._growth_tracker.copy_(tracker)  # type: ignore[union-attr,arg-type]
        # SYNC (closure steps only): was this step non-finite? Then replay it, hooks armed.
        if (closure is not None and self.model is not None and self.config.forensics
                and bool(decision[Dec.LOSS_NONFINITE] + decision[Dec.GRAD_NONFINITE] > 0)):
            self._replay(closure, decision, gathered)
        if self._batch_ids:
            self._step_batch_ids[self._step] = self._batch_ids
            self._batch_ids = []

        payload = torch.cat([decision, gathered.reshape(-1).float(), norms])
        self._enqueue(payload)
        self.backend.reset_pre_reduction()
        self._loss_sum, self._loss_count = None, 0
        self._step += 1
        self._stage = "stepped"
        every = self.config.consistency_every
        if every is not None and self.backend.world_size > 1 and self._step % every == 0:
            self._check_consistency()  # collective, on the same step everywhere
        if synced or self.device.type == "cpu":
            self._materialize()
            self._raise_escalation()
            if self._ladder is not None and self._ladder.pending_rollback is not None:
                self._ladder.rollback(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (and any loss kept from a ``backward()`` not followed by ``step()``)."""
        self.backend.zero_grad(self.optimizer, set_to_none)
        self._loss_sum, self._loss_count = None, 0
        self._stage = "ready"

    # ------------------------------------------------------------------ results
    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` skipped the inner optimizer. Reading it right after a step
        that did not synchronise (fused optimizer on CUDA) waits for that step's decision."""
        self._materialize()
        last = self._history[-1] if len(self._history) else None
        return bool(last and last.skipped)

    @property
    def last_report(self) -> StepReport | None:
        """The last step's :class:`StepReport` (waits for it like ``step_was_skipped``)."""
        self._materialize()
        return self._history[-1] if len(self._history) else None

    @property
    def history(self) -> History:
        """The last ``config.history_size`` reports; ``history[s]`` is step ``s``'s."""
        self._materialize()
        return self._history

    @property
    def anomalies(self) -> Sequence[Anomaly]:
        """Anomalies recorded so far, oldest first (the last ``config.max_anomalies``)."""
        self._materialize()
        return tuple(self._anomalies)

    @property
    def step_count(self) -> int:
        """Number of ``step()`` calls so far (skipped ones included)."""
        return self._step

    @property
    def skipped_steps(self) -> int:
        """Number of skipped steps among the reported ones."""
        self._materialize()
        return self._skipped_total

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(self._names.values())

    def get_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Synchronises the host."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def flush(self) -> None:
        """Block until every step's report has reached the host and the exporters."""
        self._materialize()

    def close(self) -> None:
        """Flush, then close the exporters and remove backend hooks. Idempotent."""
        if self._closed:
            return
        try:
            self._materialize()
        finally:
            self._closed = True
            self._exporter.close()
            self.backend.close()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer, scaler and every piece of guard state, as plain Python values (plus the
        inner optimizer's tensors). Synchronises the host (reads device counters)."""
        self._materialize()
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "ampguard": {
                "version": _STATE_VERSION,
                "precision": self.precision,
                "step": self._step,
                "skipped_total": self._skipped_total,
                "consecutive_skips": self._consecutive_skips,
                "overflow_run": int(self._scale_state.overflow_run.item()),
                "grad_ema": float(self._spikes.grad_ema.item()),
                "loss_ema": float(self._spikes.loss_ema.item()),
                "ema_count": int(self._spikes.count.item()),
                "quarantine": list(self.quarantine),
                "escalation": self._ladder.state_dict() if self._ladder is not None else None,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the run then continues bit-for-bit."""
        if not isinstance(state_dict, dict) or "ampguard" not in state_dict or "optimizer" not in state_dict:
            raise ValueError(
                "load_state_dict() expects a dict made by GuardedOptimizer.state_dict() (keys 'optimizer', "
                "'scaler', 'ampguard'); to load a plain optimizer state, use opt.optimizer.load_state_dict()"
            )
        g = state_dict["ampguard"]
        if g.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported ampguard state version {g.get('version')!r} (expected {_STATE_VERSION})")
        if g.get("precision") != self.precision:
            raise ValueError(
                f"state was saved with precision={g.get('precision')!r}, this guard runs {self.precision!r}"
            )
        if (state_dict["scaler"] is None) != (self.scaler is None):
            raise ValueError("state and guard disagree on loss scaling (one has a GradScaler, the other not)")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
        self._pending.clear()
        self._step = int(g["step"])
        self._history = History(self.config.history_size)
        self._history._count = self._step  # reports before the resume are not available
        self._skipped_total = int(g["skipped_total"])
        self._consecutive_skips = int(g["consecutive_skips"])
        self._scale_state.overflow_run.fill_(int(g["overflow_run"]))
        self._spikes.grad_ema.fill_(float(g["grad_ema"]))
        self._spikes.loss_ema.fill_(float(g["loss_ema"]))
        self._spikes.count.fill_(int(g["ema_count"]))
        self.quarantine = list(g.get("quarantine", ()))
        if self._ladder is not None and g.get("escalation"):
            self._ladder.load_state_dict(g["escalation"])
        self._stage = "ready"

    # ------------------------------------------------------------------ internals
    def _check_open(self, call: str) -> None:
        if self._closed:
            raise GuardStateError(f"{call}() called after close(); wrap the optimizer again to keep training")

    def _check_step_call(self) -> None:
        self._check_open("step")
        by_scaler = "found_inf" in self.__dict__ or "grad_scale" in self.__dict__
        if by_scaler:
            # GradScaler.step(guarded) lands here (the guard declares _step_supports_amp_scaling so
            # that it does, having only multiplied the gradients by 1.0). Undo its bookkeeping.
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            if self.scaler is not None:
                self.scaler._per_optimizer_states.pop(id(self), None)
            raise GuardStateError(
                "scaler.step(opt) was called on a guarded optimizer: the guard already unscales, checks and "
                "steps. Replace `scaler.step(opt); scaler.update()` with `opt.step()`. Nothing was changed."
            )
        if self._stage != "backward":
            what = "step()" if self._stage == "stepped" else "zero_grad()"
            raise GuardStateError(
                f"step() called after {what} with no opt.backward(loss) in between. Compute the loss and call "
                "opt.backward(loss) (not loss.backward(): the guard must scale and check it) before opt.step(). "
                "Nothing was changed."
            )

    def _decide(self, gathered: torch.Tensor, scaler_view: ScalerView | None) -> tuple[torch.Tensor, Any]:
        """:func:`~ampguard.policies.decide`; on CUDA replayed from a CUDA graph captured on the
        second step (``GuardConfig.cuda_graph``): ~70 tiny kernels become one launch."""

        def run(g: torch.Tensor) -> tuple[torch.Tensor, Any]:
            return decide(g, config=self.config, spikes=self._spikes, scale_state=self._scale_state,
                          scaler=scaler_view, grads_sharded=self.backend.grads_sharded)

        if self.device.type != "cuda" or not self.config.cuda_graph or self._graph_failed:
            return run(gathered)
        key = (tuple(gathered.shape), None if scaler_view is None else
               (scaler_view.growth_factor, scaler_view.backoff_factor, scaler_view.growth_interval))
        if self._graph is None or self._graph[0] != key:
            if not self._decided_eagerly:  # the first decision of this process runs eagerly (lazy init)
                self._decided_eagerly = True
                return run(gathered)
            try:
                static_in = gathered.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # records (does not run) the kernels; one-time sync
                    static_out = run(static_in)
                self._graph = (key, graph, static_in, static_out)
            except Exception as exc:  # capture is an optimisation: never fail a step over it
                self._graph_failed = True
                warnings.warn(f"ampguard: CUDA graph capture of the step decision failed ({exc}); running it "
                              "eagerly (set GuardConfig(cuda_graph=False) to silence this)", RuntimeWarning,
                              stacklevel=3)
                return run(gathered)
        _, graph, static_in, static_out = self._graph
        static_in.copy_(gathered)
        graph.replay()
        return static_out

    def _unscale(self) -> dict[torch.device, torch.Tensor]:
        scaler = self.scaler
        assert scaler is not None  # internal: only called with a scaler
        states = scaler._per_optimizer_states
        mine = states.get(id(self))
        if mine is not None and mine["stage"].name == _UNSCALED:
            # The user called scaler.unscale_(opt) on the guarded optimizer (e.g. to clip by hand):
            # the gradients are unscaled already; adopt that check instead of unscaling twice.
            states[id(self.optimizer)] = states.pop(id(self))
        elif states[id(self.optimizer)]["stage"].name == _READY:
            scaler.unscale_(self.optimizer)
        return states[id(self.optimizer)]["found_inf_per_device"]

    def _inner_step(self, skip: torch.Tensor, found_inf_per_device: dict[torch.device, torch.Tensor]) -> bool:
        """Step the inner optimizer unless ``skip`` (device 0/1 float). Returns whether it synced."""
        inner = self.optimizer
        if self.scaler is not None:
            for dev, t in found_inf_per_device.items():
                t.copy_(skip)  # GradScaler skips exactly when the guard decided to
                # ShardedGradScaler's found_inf has shape [1]; fused optimizers' kernels need 0-d
                found_inf_per_device[dev] = t.reshape(())
            with self.backend.step_context(inner):
                self.scaler.step(inner)  # non-fused: GradScaler's own found_inf.item() (a sync)
            return not self._fused
        if self._fused:
            inner.grad_scale = None  # type: ignore[attr-defined]
            inner.found_inf = skip  # type: ignore[attr-defined]
            try:
                with self.backend.step_context(inner):
                    inner.step()
            finally:
                del inner.grad_scale, inner.found_inf  # type: ignore[attr-defined]
            return False
        if not skip.item():  # SYNC: the one a non-fused optimizer needs to skip (GradScaler's too)
            with self.backend.step_context(inner):
                inner.step()
        return True

    def _enqueue(self, payload: torch.Tensor) -> None:
        if payload.device.type == "cuda":
            buf = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
            buf.copy_(payload, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            buf, event = payload.to("cpu", copy=True), None
        memory = None
        if self.device.type == "cuda" and self.config.track_memory:
            # Host-side counters of the caching allocator: no device sync. One nested-stats call
            # (torch.cuda.max_memory_allocated flattens and sorts every statistic, twice the cost).
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
            memory = (int(stats["allocated_bytes"]["all"]["peak"]), int(stats["reserved_bytes"]["all"]["peak"]))
            torch.cuda.reset_peak_memory_stats(self.device)
        self._pending.append(_Pending(self._step, buf, event, memory))

    def _materialize(self) -> None:
        """Turn every pending step's values into a StepReport, in step order, and export it."""
        while self._pending:
            pending = self._pending.popleft()
            if pending.event is not None:
                pending.event.synchronize()  # waits for that step's copy only; usually done already
            values = pending.buf.tolist()
            report, anomalies = self._build_report(pending.step, values)
            if pending.memory is not None:
                report = dataclasses.replace(
                    report, memory_allocated_peak=pending.memory[0], memory_reserved_peak=pending.memory[1]
                )
            if self._divergence is not None and self._divergence.step == pending.step:
                anomalies.append(self._divergence)
                self._divergence = None
            anomalies = self._after_report(report, anomalies)
            self._history.append(report)
            self._anomalies.extend(anomalies)
            self._exporter.export(report, anomalies)
            if report.skipped:
                self._skipped_total += 1
                self._consecutive_skips += 1
            else:
                self._consecutive_skips = 0
            limit = self.config.max_consecutive_skips
            if limit is not None and self._consecutive_skips >= limit and self._escalation is None:
                self._escalation = NonFiniteError(
                    f"{self._consecutive_skips} consecutive steps skipped (GuardConfig.max_consecutive_skips="
                    f"{limit}); last at step {report.step}: {report.reason}, loss={report.loss}, "
                    f"grad_norm={report.grad_norm}, loss_scale={report.loss_scale}. "
                    "Look at opt.anomalies for where it started.",
                    report,
                )

    def _check_consistency(self) -> None:
        """Compare step/skip counts, loss scale and a parameter fingerprint across ranks
        (:mod:`ampguard.consistency`). collective; synchronises the host. A mismatch becomes a
        ``rank_divergence`` anomaly on the step just taken, and raises per ``on_divergence``."""
        from .consistency import check

        div = check(
            self.backend,
            step=self._step,
            skipped=self._skipped_total,
            scale=self.scaler._scale if self.scaler is not None and self.scaler._scale is not None else 1.0,
            params=list(_params(self.optimizer)),
            device=self.device,
            compare_params=not self.backend.grads_sharded,
        )
        if div is None:
            return
        self._divergence = Anomaly(self._step - 1, AnomalyKind.RANK_DIVERGENCE, div.describe(), div.ranks)
        if self.config.on_divergence == "raise":
            self._materialize()
            raise RankDivergenceError(f"step {self._step - 1}: {div.describe()}", div.ranks)

    def _after_report(self, report: StepReport, anomalies: list[Anomaly]) -> list[Anomaly]:
        """Host-side follow-up of one report: forensics arming and findings, quarantine, ladder."""
        finding = self._findings.pop(report.step, None)
        if finding is not None and anomalies and anomalies[0].kind in ("nonfinite_loss", "nonfinite_grad", "overflow"):
            first = anomalies[0]
            kind = first.kind
            if kind == "overflow" and finding.cause != "overflow":
                kind = AnomalyKind.NONFINITE_GRAD  # fp16, but forensics found a NaN the scale did not cause
            anomalies[0] = dataclasses.replace(
                first, kind=kind, module=finding.module, phase=finding.phase, cause=finding.cause,
                detail=f"{first.detail}. Forensics: {finding.detail}",
            )
        ids = self._step_batch_ids.pop(report.step, None)
        if report.nonfinite:
            if ids:
                self.quarantine.extend(ids)
            self._armed_clean = 0
            if self._localizer is None and self.config.forensics and self.model is not None:
                self._localizer = Localizer(self.model)  # hooks from the next forward on
        elif self._localizer is not None:
            self._armed_clean += 1
            if self._armed_clean >= self.config.forensics_window:
                self._localizer.remove()
                self._localizer = None
        if self._ladder is not None:
            extra, diagnosis = self._ladder.observe(self, report)
            anomalies = [*anomalies, *extra]
            if diagnosis is not None and self._escalation is None:
                if self._ladder.on_abort is not None:
                    self._ladder.on_abort(self, diagnosis)
                self._escalation = NonFiniteError(diagnosis, report)
        return anomalies

    def _collect_finding(self, decision: torch.Tensor, gathered: torch.Tensor) -> None:
        """Armed steps only: read the hooks' flags (one host sync) and keep what they name."""
        assert self._localizer is not None  # internal
        loss_finite = not bool(decision[Dec.LOSS_NONFINITE] > 0)  # SYNC (armed steps only)
        grad_bad = bool(decision[Dec.GRAD_NONFINITE] > 0)
        local_loss_finite = not bool(gathered[self.backend.rank, Loc.LOSS_NONFINITE] > 0)
        finding = self._localizer.collect(loss_finite=local_loss_finite, fp16_scaling=self.scaler is not None)
        if grad_bad or not loss_finite:  # the same on every rank: the share below is a collective
            finding = self._share(finding, gathered)
            if finding is not None:
                self._findings[self._step] = finding

    def _share(self, finding: Finding | None, gathered: torch.Tensor) -> Finding | None:
        """Every rank localises its own; all agree on the view of the first rank where the
        non-finite values originated. collective (non-finite armed steps only; blocks)."""
        if self.backend.world_size == 1:
            return dataclasses.replace(finding, rank=self.backend.rank) if finding is not None else None
        views = self.backend.all_gather_object(finding)
        rows = gathered.float().cpu().tolist()
        origins = _origin_ranks([list(r) for r in rows])
        order = [*origins, *(r for r in range(len(views)) if r not in origins)]
        candidates = [r for r in order if views[r] is not None]
        candidates.sort(key=lambda r: views[r].phase == "loss")  # a module beats "the loss itself"
        if not candidates:
            return None
        r = candidates[0]
        view = views[r]
        prefix = f"rank {r}: "
        return dataclasses.replace(view, rank=r, detail=view.detail if view.detail.startswith(prefix)
                                   else prefix + view.detail)

    def _replay(self, closure: Callable[[], Any], decision: torch.Tensor, gathered: torch.Tensor) -> None:
        """Re-run ``closure`` on the same batch at this step's loss scale with hooks armed."""
        assert self.model is not None  # internal: only called with a model
        localizer = self._localizer if self._localizer is not None else Localizer(self.model)
        temporary = self._localizer is None
        new_scale = None
        if self.scaler is not None:
            new_scale = self.scaler._scale.clone()  # type: ignore[union-attr]
            self.scaler._scale.copy_(decision[Dec.SCALE])  # type: ignore[union-attr]
        self._replaying, self._replay_loss = True, None
        try:
            localizer.reset()
            with torch.enable_grad():
                closure()
            self.backend.before_unscale(self.optimizer)  # Horovod: finish the replay's all-reduce
            loss_finite = self._replay_loss is not None and bool(torch.isfinite(self._replay_loss))
            grads_finite = all(
                bool(torch.isfinite(p.grad).all()) for p in _params(self.optimizer) if p.grad is not None
            )
            first_pass = self._findings.get(self._step)  # what armed hooks saw on the first pass
            if first_pass is not None and first_pass.rank != self.backend.rank:
                first_pass = None  # another rank's view; this rank localises its own replay
            if loss_finite and grads_finite:
                if first_pass is not None:
                    finding = dataclasses.replace(
                        first_pass, cause=Cause.TRANSIENT,
                        detail=f"{first_pass.detail}; a replay of the same batch was clean: suspect hardware or a race")
                else:
                    finding = Finding("", Phase.LOSS, Cause.TRANSIENT, "", math.nan,
                                      "a replay of the same batch was clean: suspect hardware or a race")
                localizer.reset()
            else:
                found = localizer.collect(loss_finite=loss_finite, fp16_scaling=self.scaler is not None)
                finding = found or Finding("", Phase.BACKWARD, Cause.NAN, "", math.nan,
                                           "the replay was non-finite again, outside any module hook")
            shared = self._share(finding, gathered)
            if shared is not None:
                self._findings[self._step] = shared
        finally:
            self._replaying = False
            if self.scaler is not None and new_scale is not None:
                self.scaler._scale.copy_(new_scale)  # type: ignore[union-attr]
            if temporary:
                localizer.remove()
            self.backend.zero_grad(self.optimizer, True)

    def _rollback_consuming_step(self) -> None:
        """A rollback decided at the start of this step (lagged report): restore, and spend this
        step on it, identically on every rank (no collective runs on this step anywhere)."""
        assert self._ladder is not None  # internal
        self._ladder.rollback(self)
        self.backend.zero_grad(self.optimizer, True)
        scale = self.get_scale()
        report = StepReport(step=self._step, skipped=True, reason=SkipReason.ROLLBACK, loss=math.nan, loss_scale=scale,
                            next_loss_scale=scale, grad_norm=math.nan, nonfinite_grads=0, nonfinite_loss=False,
                            world_size=self.backend.world_size, rank=self.backend.rank, wall_time=time.time())
        self._history.append(report)
        self._exporter.export(report, [])
        self._skipped_total += 1
        self._loss_sum, self._loss_count, self._batch_ids = None, 0, []
        self._step += 1
        self._stage = "stepped"

    def _raise_escalation(self) -> None:
        if self._escalation is not None:
            err, self._escalation = self._escalation, None
            raise err

    def _build_report(self, step: int, values: list[float]) -> tuple[StepReport, list[Anomaly]]:
        d = values[:DECISION_K]
        world = self.backend.world_size
        g = values[DECISION_K : DECISION_K + world * LOCAL_K]
        rows = [g[r * LOCAL_K : (r + 1) * LOCAL_K] for r in range(world)]
        norms = values[DECISION_K + world * LOCAL_K :]
        names = list(self._names.values())
        bad_params = tuple(
            names[i] if i < len(names) else f"param{i}" for i, n in enumerate(norms) if not math.isfinite(n)
        )
        grad_bad = d[Dec.GRAD_NONFINITE] > 0
        loss_bad = d[Dec.LOSS_NONFINITE] > 0
        ranks = _origin_ranks(rows) if world > 1 else ()
        every = self.config.param_norms_every
        want_norms = grad_bad or (every is not None and step % every == 0)
        report = StepReport(
            step=step,
            skipped=d[Dec.SKIP] > 0,
            reason=REASONS[int(d[Dec.REASON])],  # type: ignore[arg-type]
            loss=d[Dec.LOSS],
            loss_scale=d[Dec.SCALE],
            next_loss_scale=d[Dec.NEXT_SCALE],
            grad_norm=d[Dec.GRAD_NORM],
            nonfinite_grads=int(d[Dec.NONFINITE_TENSORS]),
            nonfinite_loss=loss_bad,
            nonfinite_ranks=ranks,
            clip_coef=d[Dec.CLIP_COEF] if self.config.clip_grad_norm is not None else 1.0,
            grad_spike=d[Dec.GRAD_SPIKE] > 0,
            loss_spike=d[Dec.LOSS_SPIKE] > 0,
            world_size=world,
            rank=self.backend.rank,
            param_norms=tuple(norms) if want_norms else None,
            wall_time=time.time(),
        )
        anomalies: list[Anomaly] = []
        scale_txt = ""
        if self.scaler is not None:
            if d[Dec.BACKOFF] > 0:
                scale_txt = f"; loss scale backed off {d[Dec.SCALE]:g} -> {d[Dec.NEXT_SCALE]:g}"
            elif grad_bad:
                scale_txt = f"; loss scale kept at {d[Dec.SCALE]:g} (hysteresis={self.config.hysteresis})"
            elif d[Dec.SKIP] > 0:
                scale_txt = f"; loss scale held at {d[Dec.SCALE]:g} (the gradients were finite)"
        where = f" on rank(s) {list(ranks)}" if ranks else ""
        if loss_bad:
            anomalies.append(
                Anomaly(step, AnomalyKind.NONFINITE_LOSS, f"loss was {d[Dec.LOSS]}{where}; step skipped{scale_txt}",
                        ranks, bad_params[:8], phase=Phase.LOSS)
            )
        elif grad_bad:
            kind = AnomalyKind.OVERFLOW if self.scaler is not None else AnomalyKind.NONFINITE_GRAD
            what = f"{int(d[Dec.NONFINITE_TENSORS])} gradient tensor(s) non-finite"
            if kind == "overflow":
                what += f" at loss scale {d[Dec.SCALE]:g}"
            first = f" (first: {', '.join(bad_params[:3])})" if bad_params else ""
            anomalies.append(Anomaly(step, kind, f"{what}{first}{where}; step skipped{scale_txt}", ranks,
                                     bad_params[:8]))
        if report.grad_spike:
            act = "skipped" if report.skipped else "taken (on_spike='warn')"
            anomalies.append(Anomaly(step, AnomalyKind.GRAD_SPIKE, f"gradient norm {report.grad_norm:.4g} exceeded "
                                     f"{self.config.grad_spike_factor}x its running average; step {act}", ranks))
        if report.loss_spike:
            act = "skipped" if report.skipped else "taken (on_spike='warn')"
            anomalies.append(Anomaly(step, AnomalyKind.LOSS_SPIKE, f"loss {report.loss:.4g} exceeded "
                                     f"{self.config.loss_spike_factor}x its running average; step {act}", ranks))
        if d[Dec.FLOOR] > 0:
            anomalies.append(Anomaly(step, AnomalyKind.SCALE_FLOOR, f"loss scale reached the floor min_scale="
                                     f"{self.config.min_scale:g}: fp16 overflows persist at the smallest allowed "
                                     "scale, the model likely needs bf16/fp32 or a fix", ranks))
        return report, anomalies


def _origin_ranks(rows: list[list[float]]) -> tuple[int, ...]:
    """Ranks where the non-finite values originated, from every rank's local vector."""
    loss_bad = {r for r, row in enumerate(rows) if row[Loc.LOSS_NONFINITE] > 0}
    pre = {r for r, row in enumerate(rows) if row[Loc.PRE_REDUCTION] > 0}
    # Counted tensors first: with sharded (DTensor) gradients GradScaler's found_inf is already
    # reduced across ranks (DTensor's unscale all-reduces it), so only the counts are local.
    post = {r for r, row in enumerate(rows) if row[Loc.NONFINITE_TENSORS] > 0} or {
        r for r, row in enumerate(rows) if row[Loc.FOUND_INF] > 0
    }
    origin = loss_bad | pre
    # corrupted after reduction on some ranks only (when nothing was non-finite before it: with
    # sharded gradients a rank's bad contribution lands in whichever ranks own those shards)
    if post and not pre and len(post) < len(rows):
        origin |= post
    if not origin:
        origin = post
    return tuple(sorted(origin))


def _param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> dict[int, str]:
    """id(param) -> name, in param_groups order; names as the user wrote them (no DDP ``module.``)."""
    known: dict[int, str] = {}
    if model is not None:
        inner_model = getattr(model, "module", model)  # DDP / DataParallel wrappers
        for name, p in inner_model.named_parameters():
            known.setdefault(id(p), name.replace("_fsdp_wrapped_module.", "").replace("_orig_mod.", ""))
    names: dict[int, str] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            names[id(p)] = known.get(id(p), f"group{gi}.param{pi}")
    return names


def _version() -> str:
    from . import __version__

    return __version__


def _params(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def wrap(
    optimizer: torch.optim.Optimizer,
    *,
    model: torch.nn.Module | None = None,
    scaler: torch.amp.GradScaler | None = None,
    precision: str = "auto",
    config: GuardConfig | dict[str, Any] | None = None,
    exporters: Sequence[Exporter] = (),
    collective: Any = None,
    on_rollback: Callable[[Any, int], None] | None = None,
    on_abort: Callable[[Any, str], None] | None = None,
) -> GuardedOptimizer:
    """Wrap ``optimizer`` so every step is checked, agreed across ranks, and reported.

    - ``precision``: "fp16" (loss scaling: ``scaler`` if given, else a new
      ``torch.amp.GradScaler`` for the parameters' device with its defaults), "bf16" or "fp32"
      (no loss scaling; non-finite steps are still skipped), or "auto": "fp16" when an enabled
      ``scaler`` is given; otherwise "bf16" where the device runs it (CPU, CUDA compute
      capability >= 8.0), else "fp16" with a new scaler.
    - ``scaler``: used as is (its init_scale, growth/backoff factors and interval hold).
    - ``config``: a :class:`GuardConfig`, or a dict of its fields (unknown keys are an error).
    - ``exporters``: where reports go (Prometheus, TensorBoard, JSONL, or your own).
    - ``on_rollback(opt, step)`` / ``on_abort(opt, diagnosis)``: callbacks for the escalation
      ladder (``GuardConfig.escalation``): restore your own checkpoint instead of the in-memory
      snapshot; save a checkpoint before training stops.
    - ``collective``: the backend; by default chosen from the environment (a Horovod
      ``DistributedOptimizer`` -> Horovod; an initialised torch.distributed -> torch.distributed;
      else one process).

    collective: in a distributed run every rank must call ``wrap()`` (it agrees on a run id).
    Raises ``ValueError``/``GuardStateError``/:class:`~ampguard.hardware.UnsupportedPrecisionError`
    on bad input, before changing anything.
    """
    if isinstance(optimizer, GuardedOptimizer):
        raise GuardStateError(
            "this optimizer is already guarded; wrap the inner optimizer once (opt.optimizer is the inner one)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"wrap() expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if config is None:
        config = GuardConfig()
    elif isinstance(config, dict):
        config = GuardConfig.from_dict(config)
    elif not isinstance(config, GuardConfig):
        raise TypeError(f"config must be a GuardConfig or a dict of its fields, got {type(config).__name__}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision={precision!r}; allowed: {' | '.join(map(repr, _PRECISIONS))}")
    params = list(_params(optimizer))
    if not params:
        raise ValueError("the optimizer has no parameters: there is nothing to guard (check its param_groups)")
    device = params[0].device
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    scaler_enabled = scaler is not None and scaler.is_enabled()

    if precision == "auto":
        if scaler_enabled or (device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0)):
            precision = "fp16"
        else:
            precision = "bf16"
    if precision == "fp16":
        if scaler is not None and not scaler_enabled:
            raise ValueError(
                "precision='fp16' with a disabled GradScaler: fp16 gradients need loss scaling. Pass an enabled "
                "scaler, no scaler (the guard makes one), or precision='bf16'/'fp32'."
            )
        if scaler is None:
            scaler = torch.amp.GradScaler(device.type)
        if scaler._device != device.type:
            raise ValueError(
                f"the GradScaler was made for {scaler._device!r} but the parameters are on {device}; "
                f"use torch.amp.GradScaler({device.type!r})"
            )
    else:
        if scaler_enabled:
            raise ValueError(
                f"precision={precision!r} with an enabled GradScaler: loss scaling is for fp16. Drop the scaler or "
                "use precision='fp16'."
            )
        scaler = None
    check_precision(precision, device)

    if collective is None:
        from .backends import select_backend

        collective = select_backend(optimizer)
    if precision == "fp16" and scaler is not None and scaler._scale is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler._lazy_init_scale_growth_tracker(device)  # so the state is complete before step 0
    return GuardedOptimizer(
        optimizer,
        precision=precision,
        scaler=scaler,
        config=config,
        model=model,
        exporters=exporters,
        backend=collective,
        device=device,
        on_rollback=on_rollback,
        on_abort=on_abort,
    )

