"""``wrap()``: check what the user handed over, resolve precision, scaler and backend, and build
the :class:`~ampguard.guard.GuardedOptimizer`. Nothing is changed before every check passed."""

from __future__ import annotations

import os
import platform
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._version import __version__
from .config import GuardConfig
from .errors import GuardStateError
from .exporters.base import Exporter
from .fp8 import Fp8Monitor, float8_modules
from .guard import GuardedOptimizer
from .hardware import check_precision
from .optimizer_view import param_names
from .records import RunInfo
from .scaling import GradScalerAdapter, SharedScaler, f32
from .vocab import Precision

__all__ = ["wrap"]

_PRECISIONS = ("auto", "fp16", "bf16", "fp32")


def _resolve_precision(precision: str, scaler: torch.amp.GradScaler | None,
                       device: torch.device) -> tuple[str, torch.amp.GradScaler | None]:
    """The precision to run and the scaler to use for it (a new one for fp16 when none is given;
    none for a disabled one: ``GradScaler(enabled=False)`` scales nothing, and neither does the guard)."""
    scaler_enabled = scaler is not None and scaler.is_enabled()
    if precision == "auto":
        old_cuda = device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0)
        precision = "fp16" if scaler_enabled or old_cuda else "bf16"
    if precision != "fp16":
        if scaler_enabled:
            raise ValueError(f"precision={precision!r} with an enabled GradScaler: loss scaling is for fp16. Drop the "
                             "scaler or use precision='fp16'.")
        return precision, None
    if scaler is not None and not scaler_enabled:  # torch's GradScaler(enabled=use_amp): a pass-through
        return precision, None
    if scaler is None:
        scaler = torch.amp.GradScaler(device.type)
    if GradScalerAdapter(scaler).device_type != device.type:
        raise ValueError(f"the GradScaler was made for {GradScalerAdapter(scaler).device_type!r} but the parameters "
                         f"are on {device}; use torch.amp.GradScaler({device.type!r})")
    return precision, scaler


def _run_info(precision: str, device: torch.device) -> Callable[[GuardedOptimizer], RunInfo]:
    def build(guard: GuardedOptimizer) -> RunInfo:
        backend = guard.backend
        run_id = os.environ.get("AMPGUARD_RUN_ID") or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        run_id = backend.broadcast_object(run_id, 0)  # collective: same id on every rank
        return RunInfo(run_id=str(run_id), rank=backend.rank, local_rank=backend.local_rank,
                       world_size=backend.world_size, precision=precision, backend=backend.name, device=str(device),
                       param_names=guard.param_names, param_groups=len(guard.optimizer.param_groups),
                       modules=guard._indicators.modules if guard._indicators is not None else (),
                       versions=(("ampguard", __version__), ("torch", torch.__version__),
                                 ("python", platform.python_version())),
                       loss_scale_floor=None if guard.scaler is None else f32(guard.config.min_scale))

    return build


def _check_devices(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None,
                   params: list[torch.Tensor]) -> None:
    """One device type (one GradScaler, one autocast; several CUDA devices are fine), none of it meta."""
    kinds = sorted({p.device.type for p in params})
    if "meta" not in kinds and len(kinds) == 1:
        return
    names = param_names(optimizer, model)
    odd = "meta" if "meta" in kinds else next(k for k in kinds if k != params[0].device.type)
    first = next(n for n, p in zip(names, params) if p.device.type == odd)
    counts = ", ".join(f"{k} ({sum(p.device.type == k for p in params)})" for k in kinds)
    if odd == "meta":
        raise ValueError(f"parameter {first!r} is on the meta device (no storage: nothing can be trained); "
                         f"parameters by device: {counts}. Materialise the model first (e.g. "
                         "model.to_empty(device=...) and initialise it), then build the optimizer and wrap it.")
    raise ValueError(f"the optimizer's parameters are on several device types: {counts} (e.g. {first!r} on {odd}). "
                     "The guard steps one device type (one GradScaler, one autocast; several CUDA devices are "
                     "fine): move the model with model.to(device) before building the optimizer.")


def _check_exporter_instances(exporters: Any) -> None:
    """Refuse an exporter class where an instance belongs: a class has ``open``/``export``/``close``
    too, so it would pass for an exporter and then fail on every call (retried for ever)."""
    given = [exporters] if isinstance(exporters, type) else exporters
    for e in given if isinstance(given, (list, tuple)) else ():  # anything else: MultiExporter checks it
        if isinstance(e, type):
            raise TypeError(f"exporters: {e.__name__} is a class, not an exporter; pass an instance, "
                            f"{e.__name__}(...), e.g. exporters=[ampguard.JsonlExporter('events-{{rank}}.jsonl')]")


def _is_accelerated(optimizer: torch.optim.Optimizer) -> bool:
    """An accelerate ``AcceleratedOptimizer`` (told by its class's module: accelerate need not be installed)."""
    return any(cls.__module__.startswith("accelerate.") for cls in type(optimizer).__mro__)


def _fp8_monitor(fp8: bool | None, model: torch.nn.Module | None, config: GuardConfig) -> Fp8Monitor | None:
    """``wrap(fp8=...)``'s monitor: hooks on the model's torchao ``Float8Linear`` modules (see :func:`wrap`)."""
    if fp8 is not None and not isinstance(fp8, bool):
        raise TypeError(f"wrap(fp8={fp8!r}); allowed: None (on when the model holds a torchao Float8Linear) | "
                        "True | False")
    if fp8 is False or (fp8 is None and (model is None or not float8_modules(model))):
        return None
    if model is None:
        raise ValueError("wrap(fp8=True) without model=: fp8 monitoring hooks the model's torchao Float8Linear "
                         "modules; pass wrap(model=model, fp8=True). Nothing was changed.")
    return Fp8Monitor(model, numerics_every=config.numerics_every or FP8_SAMPLE_EVERY)


FP8_SAMPLE_EVERY = 10
"""Steps between two fp8 underflow samples (and published fp8 statistics) when ``numerics_every`` is None."""


# Long (~80 lines) because of its docstring, the user-facing contract; the body is the checks in order.
def wrap(
    optimizer: torch.optim.Optimizer,
    *,
    model: torch.nn.Module | None = None,
    scaler: torch.amp.GradScaler | None = None,
    precision: Precision = "auto",
    config: GuardConfig | dict[str, Any] | None = None,
    exporters: Sequence[Exporter] | Exporter = (),
    backend: Any = None,
    on_rollback: Callable[[Any, int], None] | None = None,
    on_abort: Callable[[Any, str], None] | None = None,
    collective: Any = None,
    accelerator: object | None = None,
    fp8: bool | None = None,
) -> Any:
    """Wrap ``optimizer`` so every step is checked, agreed across ranks, and reported.

    - ``precision``: "fp16" (loss scaling: ``scaler`` if given, else a new
      ``torch.amp.GradScaler`` for the parameters' device with its defaults), "bf16" or "fp32"
      (no loss scaling; non-finite steps are still skipped), or "auto": "fp16" when an enabled
      ``scaler`` is given; otherwise "bf16" where the device runs it (CPU, CUDA compute
      capability >= 8.0), else "fp16" with a new scaler.
    - ``scaler``: used as is (its init_scale, growth/backoff factors and interval hold), and
      shared: ``scaler.scale(loss).backward()`` feeds the guarded step. Several optimizers may
      share one (torch's multi-optimizer pattern): wrap each with it; their scale is updated once
      per iteration, after the last of them steps (:class:`~ampguard.scaling.SharedScaler`). A
      disabled one (``GradScaler(enabled=False)``, torch's ``enabled=use_amp``) with "fp16": no loss
      scaling, as that scaler does (``opt.scaler`` is then None).
    - ``config``: a :class:`GuardConfig`, or a dict of its fields (unknown keys are an error).
    - ``exporters``: where reports go (Prometheus, TensorBoard, JSONL, or your own): a sequence of
      exporters, or one.
    - ``on_rollback(opt, step)`` / ``on_abort(opt, diagnosis)``: callbacks for the escalation
      ladder (``GuardConfig.escalation``).
    - ``backend``: how ranks talk (:class:`~ampguard.backends.Backend`); by default chosen from the
      environment (a Horovod ``DistributedOptimizer`` -> Horovod; an initialised
      torch.distributed -> torch.distributed; else one process). ``collective=`` is its
      deprecated name.
    - ``accelerator``: the accelerate ``Accelerator`` that prepared ``optimizer``, for
      ``ampguard.wrap(accelerator.prepare(optimizer), accelerator=accelerator)``: the guard shares
      its GradScaler and precision, and the returned ``GuardedAcceleratedOptimizer`` takes the
      prepared optimizer's place in it (see :mod:`ampguard.integrations.accelerate`).
    - ``fp8``: measure every torchao float8 cast of ``model`` (:class:`ampguard.fp8.Fp8Monitor`: amax and scale
      per module and role each step, the underflow every ``GuardConfig.numerics_every`` steps, 10 if None) and
      skip, on every rank, a step where one went non-finite. None (default): on when ``model`` holds a torchao
      ``Float8Linear``; True: required (an error without one); False: off. See ``docs/fp8.md``.

    collective: in a distributed run every rank must call ``wrap()`` (it agrees on a run id).
    Raises ``TypeError``/``ValueError``/``GuardStateError``/
    :class:`~ampguard.hardware.UnsupportedPrecisionError` on bad input, before changing anything.
    """
    if collective is not None:
        if backend is not None:
            raise TypeError("pass the backend once: backend=... (collective= is its deprecated name)")
        warnings.warn("wrap(collective=...) is deprecated; use wrap(backend=...)", DeprecationWarning, stacklevel=2)
        backend = collective
    if isinstance(optimizer, GuardedOptimizer):
        raise GuardStateError(
            "this optimizer is already guarded; wrap the inner optimizer once (opt.optimizer is the inner one)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"wrap() expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"wrap(model=...) expects the torch.nn.Module being trained (or None), got "
                        f"{type(model).__name__} {model!r:.60}")
    _check_exporter_instances(exporters)
    prepared = None
    if accelerator is not None or _is_accelerated(optimizer):
        from .integrations import accelerate  # the one integration wrap() knows: it imports no factory

        prepared = optimizer
        optimizer, scaler, precision = accelerate.resolve(prepared, accelerator, scaler=scaler, precision=precision)
    if config is None:
        config = GuardConfig()
    elif isinstance(config, dict):
        config = GuardConfig.from_dict(config)
    elif not isinstance(config, GuardConfig):
        raise TypeError(f"config must be a GuardConfig or a dict of its fields, got {type(config).__name__}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision={precision!r}; allowed: {' | '.join(map(repr, _PRECISIONS))}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        raise ValueError("the optimizer has no parameters: there is nothing to guard (check its param_groups)")
    _check_devices(optimizer, model, params)
    device = params[0].device
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    resolved, scaler = _resolve_precision(precision, scaler, device)
    check_precision(resolved, device)
    if scaler is not None:
        SharedScaler.check_join(scaler, optimizer, config)  # another guard's scaler: one update rule for all
    if backend is None:
        from .backends import select_backend

        backend = select_backend(optimizer)
    monitor = _fp8_monitor(fp8, model, config)  # the last check (torchao's version, Float8Linear modules)
    if scaler is not None:
        GradScalerAdapter(scaler).ensure_initialized(device)  # so the state is complete before step 0
    try:
        guard = GuardedOptimizer(optimizer, precision=resolved, scaler=scaler, config=config, model=model,
                                 exporters=exporters, backend=backend, device=device,
                                 run_info=_run_info(resolved, device), on_rollback=on_rollback,
                                 on_abort=on_abort, fp8=monitor)
    except BaseException:
        if monitor is not None:  # a refused wrap leaves no hook on the model
            monitor.close()
        raise
    if prepared is None:
        return guard
    return accelerate.attach(prepared, guard, accelerator)  # type: ignore[arg-type]
