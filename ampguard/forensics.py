"""Where a non-finite value came from (module, phase, rank) and why (overflow, NaN, transient).

Healthy runs pay nothing: no hook exists until a step goes non-finite. Then the guard arms
a :class:`Localizer` on the model for the following steps (``GuardConfig.forensics_window``
clean steps, then it disarms). While armed, every module's forward output, and the
gradients arriving at and leaving every module, are checked on device; the flags are read
with one host sync per step (armed steps only). On the next non-finite step it names the
**first** module, in execution order, whose forward output, or whose backward gradient,
became non-finite.

With a replay closure (``opt.step(closure, replay=True)``) the guard replays a non-finite step with the
hooks armed at the same loss scale, so the culprit is named on the step itself, and a
replay that comes out clean is classified ``"transient"``.

Classification (``Anomaly.cause``):

- ``"overflow"``: the culprit's computation is finite in fp32 but exceeds fp16's range
  (max-abs > 65504), or a backward gradient went to ±inf under fp16 loss scaling;
- ``"nan"``: the culprit's computation is non-finite in fp32 too (log of 0, 0/0, bad data);
- ``"transient"``: recomputing the culprit (or replaying the batch) is clean.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .vocab import Cause, Phase

__all__ = ["FP16_MAX", "Finding", "Localizer"]

FP16_MAX = 65504.0


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """What the localizer found on one step."""

    module: str
    """Qualified name as the user wrote it (no DDP ``module.`` prefix); "" for the model root."""
    phase: Phase
    """"forward" | "backward" | "loss"."""
    cause: Cause
    """"overflow" | "nan" | "transient"."""
    dtype: str
    """dtype of the non-finite tensor."""
    input_max_abs: float
    """max |x| of the culprit's (finite) input, or NaN where unknown."""
    detail: str
    rank: int | None = None
    """The rank whose view this is (in a distributed run, the first rank where it originated)."""


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(value, dict):
        for v in value.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.isfinite(t).all()


class Localizer:
    """Hooks on every module of ``model``; one record per hook firing, flags kept on device."""

    def __init__(self, model: torch.nn.Module) -> None:
        root = getattr(model, "module", model)  # DDP/FSDP wrappers: names as the user wrote them
        self.root = root
        self.modules = [(name, m) for name, m in root.named_modules()]
        self._handles: list[Any] = []
        self._recomputing = False
        self.reset()
        for idx, (_, m) in enumerate(self.modules):
            # prepend: see the inputs as the caller passed them, before other pre-hooks replace them
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(idx), prepend=True))
            self._handles.append(m.register_forward_hook(self._fwd_hook(idx)))

    # Each record: (order, module index, phase, finite flag tensor, tensor dtype).
    def reset(self) -> None:
        self._fwd: list[tuple[int, int, torch.Tensor, str, torch.Tensor | None]] = []
        self._bwd_out: dict[int, torch.Tensor] = {}  # module -> finite flag of grad at its output
        # (module, finite flag of the gradient at its input, dtype, which input tensor)
        self._bwd_in: list[tuple[int, torch.Tensor, str, int]] = []
        self._inputs: dict[int, tuple[Any, ...]] = {}
        self._order = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def _pre_hook(self, idx: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if self._recomputing or not torch.is_grad_enabled():
                return
            self._inputs[idx] = args
            x = _first_tensor(args)
            if x is not None and x.requires_grad and x.is_floating_point():
                x.register_hook(self._in_grad_hook(idx, id(x)))

        return hook

    def _fwd_hook(self, idx: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if self._recomputing or not torch.is_grad_enabled():
                return
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            x = _first_tensor(args)
            in_max = x.detach().abs().max().float() if x is not None and x.is_floating_point() and x.numel() else None
            self._fwd.append((self._order, idx, _all_finite(t.detach()), str(t.dtype), in_max))
            self._order += 1
            if t.requires_grad:
                t.register_hook(self._out_grad_hook(idx))

        return hook

    def _out_grad_hook(self, idx: int) -> Any:
        def hook(g: torch.Tensor) -> None:
            self._bwd_out[idx] = _all_finite(g)

        return hook

    def _in_grad_hook(self, idx: int, key: int) -> Any:
        def hook(g: torch.Tensor) -> None:
            self._bwd_in.append((idx, _all_finite(g), str(g.dtype), key))

        return hook

    def collect(self, *, loss_finite: bool, fp16_scaling: bool) -> Finding | None:
        """Read the flags (one host sync) and name the first culprit, or None if all were finite."""
        finding = None
        if self._fwd:
            flags = torch.stack([f[2] for f in self._fwd]).cpu().tolist()
            for (_, idx, _, dtype, in_max), ok in zip(self._fwd, flags):
                if not ok:
                    finding = self._forward_finding(idx, dtype, in_max)
                    break
        if finding is None and not loss_finite:
            finding = Finding("", Phase.LOSS, Cause.NAN, "float32", float("nan"),
                              "the forward outputs were finite; the loss itself was non-finite")
        if finding is None and self._bwd_in:
            # Backward order: the first module whose input-gradient is non-finite while the gradient
            # arriving at its output was finite produced it.
            flags = torch.stack([f[1] for f in self._bwd_in]).cpu().tolist()
            out_flags = {k: bool(v) for k, v in zip(self._bwd_out, torch.stack(list(self._bwd_out.values()))
                                                     .cpu().tolist())} if self._bwd_out else {}
            candidates = [(idx, dtype, key) for (idx, _, dtype, key), ok in zip(self._bwd_in, flags)
                          if not ok and out_flags.get(idx, True)]
            if candidates:
                # Modules sharing one input tensor (a block and its first sub-layer) get the same
                # gradient; the deepest of them is the one whose backward wrote into it.
                key = candidates[0][2]
                idx, dtype, _ = max((c for c in candidates if c[2] == key), key=lambda c: self._depth(c[0]))
                name = self.modules[idx][0]
                cause = Cause.OVERFLOW if fp16_scaling else Cause.NAN
                finding = Finding(name, Phase.BACKWARD, cause, dtype, float("nan"),
                                  f"the gradient leaving {name or 'the model'} in backward became non-finite"
                                  f" ({dtype}) while the gradient arriving at its output was finite")
        if finding is None:
            finding = self._param_finding(fp16_scaling)
        self.reset()
        return finding

    def _param_finding(self, fp16_scaling: bool) -> Finding | None:
        """No module output or input-gradient was non-finite, yet a parameter gradient is (a hook,
        a custom autograd function, corruption between backward and step): name the module that
        owns the first such parameter in backward order (the reverse of the module order)."""
        for name, module in reversed(self.modules):
            for pname, p in module.named_parameters(recurse=False):
                g = p.grad
                if g is None:
                    continue
                g = g.to_local() if callable(getattr(g, "to_local", None)) else g
                if bool(torch.isfinite(g).all()):
                    continue
                has_nan = bool(torch.isnan(g).any())
                cause = Cause.OVERFLOW if fp16_scaling and not has_nan else Cause.NAN
                full = f"{name}.{pname}" if name else pname
                return Finding(name, Phase.BACKWARD, cause, str(g.dtype), float("nan"),
                               f"the gradient of {full} is non-finite ({'NaN' if has_nan else 'inf'}) while every "
                               "module's output and input gradients were finite")
        return None

    def _depth(self, idx: int) -> int:
        name = self.modules[idx][0]
        return name.count(".") + 1 if name else 0

    def _forward_finding(self, idx: int, dtype: str, in_max: torch.Tensor | None) -> Finding:
        name, module = self.modules[idx]
        in_max_f = float(in_max) if in_max is not None else float("nan")
        cause = self._classify_forward(idx, module)
        label = name or "the model"
        detail = {
            "overflow": f"{label}'s output overflowed {dtype} (finite in fp32, beyond ±{FP16_MAX:g})",
            "nan": f"{label}'s output is non-finite in fp32 too: a genuine NaN/inf (bad input or math)",
            "transient": f"{label}'s output was non-finite but recomputing it is clean: transient or injected",
        }[cause]
        return Finding(name, Phase.FORWARD, cause, dtype, in_max_f, f"{detail}; input max |x| = {in_max_f:.4g}")

    @torch.no_grad()
    def _classify_forward(self, idx: int, module: torch.nn.Module) -> Cause:
        args = self._inputs.get(idx)
        if args is None:
            return Cause.NAN
        self._recomputing = True
        try:
            fp32_args = tuple(a.detach().float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                              for a in args)
            device_type = next((a.device.type for a in fp32_args if isinstance(a, torch.Tensor)), "cpu")
            cuda = [a.device for a in fp32_args if isinstance(a, torch.Tensor) and a.device.type == "cuda"][:1]
            # The recompute must not draw from the run's RNG (a dropout inside the module would
            # shift every later mask): fork it, CPU and the module's CUDA device.
            with torch.random.fork_rng(devices=cuda), torch.autocast(device_type=device_type, enabled=False):
                out = _first_tensor(module(*fp32_args))
            if out is None:
                return Cause.NAN
            out = out.float()
            if not bool(torch.isfinite(out).all()):
                return Cause.NAN
            if float(out.abs().max()) > FP16_MAX:
                return Cause.OVERFLOW
            return Cause.TRANSIENT
        except Exception:  # a module that cannot be re-run on its saved input: say what we know
            return Cause.NAN
        finally:
            self._recomputing = False
