"""The coarse sentinel (``GuardConfig(sentinel=...)``): a block named on the step it goes non-finite.

Opt-in. Without it, forensics hooks exist only after a non-finite step, so a name comes one
step late (two on the fused CUDA path) and only if the fault recurs (``docs/diagnosis.md``).
With it, one forward hook on each chosen block (and a forward pre-hook on the model for its
input) checks the block's output on device: one float32 sum of it (a NaN or inf anywhere makes
the sum non-finite), written into the block's slot of one preallocated buffer until the step
reads it, no host sync, no hook inside a block. One reduction kernel per block output and
nothing written the size of the activation:
``isfinite(out).all()`` costs a full-size boolean write and five more launches per block (what
each costs on a GPT-2 step: benchmarks/RESULTS.md). A sum can also overflow float32 on
finite values (a bf16/fp32 activation summing past 3.4e38): that block is then named on a step
that is non-finite for another reason, which such activations make all but certain.
:meth:`Sentinel.value` packs which came first into one float of the step's all-gathered
vector (``stats.Loc.SENTINEL``), so the step's own report names the block (or the input) on
every rank alike, and the fine hooks then arm inside that block only.

Blocks: ``"top"`` (:func:`top_blocks`: the model's children, the items of its ``ModuleList``s
and ``ModuleDict``s rather than the lists, descending into children that hold such lists, as
GPT-2's ``transformer``), or a list of module names in the order they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..module_hooks import Hook
from .compile import named_user_modules, user_module

__all__ = ["Sentinel", "top_blocks"]

_LISTS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def top_blocks(root: torch.nn.Module) -> list[str]:
    """The top-level blocks of ``root`` (see the module docstring), in registration order."""
    out: list[str] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, _LISTS):
                out.extend(f"{full}.{n}" for n, _ in child.named_children())
            elif any(isinstance(m, _LISTS) for m in child.modules()):
                visit(f"{full}.", child)
            else:
                out.append(full)

    visit("", root)
    return out


class Sentinel:
    """Flags on device: slot 0 the model's input, slot k+1 block k's output, set when non-finite."""

    def __init__(self, model: torch.nn.Module, spec: str | Sequence[str], device: torch.device) -> None:
        root = user_module(model)
        table = dict(named_user_modules(root))
        names = top_blocks(root) if spec == "top" else list(spec)
        missing = [n for n in names if n not in table]
        if missing:
            raise ValueError(f"GuardConfig.sentinel: no module named {', '.join(map(repr, missing))} in the model; "
                             f"its top-level blocks: {', '.join(top_blocks(root)[:20])}")
        if not names:
            raise ValueError("GuardConfig.sentinel='top': the model has no child module to watch; name the blocks")
        self.names: tuple[str, ...] = tuple(names)
        self.device = device
        self._sums = torch.zeros(len(names) + 1, dtype=torch.float32, device=device)
        """Slot -> float32 sum of what it saw this step (several forwards: their sums added);
        0 for a slot not seen. One buffer: the hooks write into views of it, no stack per step."""
        self._slots = [self._sums[k] for k in range(len(names) + 1)]  # the views, made once
        self._seen: set[int] = set()
        self._none = torch.full((), -1.0, dtype=torch.float32, device=device)
        self._codes = torch.arange(0, len(names) + 1, dtype=torch.float32, device=device)
        self._inf = torch.full((), torch.inf, dtype=torch.float32, device=device)
        self._handles: list[Any] = [root.register_forward_pre_hook(Hook(self._input_hook), prepend=True)]
        for k, name in enumerate(names):
            self._handles.append(table[name].register_forward_hook(Hook(self._output_hook(k + 1))))

    def _input_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled():
            x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            if x is not None:
                self._mark(0, x)

    def _output_hook(self, slot: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if not torch.is_grad_enabled():
                return
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self._mark(slot, t)

        return hook

    def _mark(self, slot: int, t: torch.Tensor) -> None:
        t = t.detach()
        if t.device != self.device:  # e.g. a CPU tensor in a CUDA model: copied, still no sync
            t = t.to(self.device, non_blocking=True)
        if slot in self._seen:  # a second forward in this step (accumulation): add its sum
            self._slots[slot].add_(t.sum(dtype=torch.float32))
        elif t.dim():  # one reduction kernel, straight into the step's buffer
            torch.sum(t, dim=tuple(range(t.dim())), dtype=torch.float32, out=self._slots[slot])
            self._seen.add(slot)
        else:
            self._slots[slot].copy_(t)
            self._seen.add(slot)

    def clear(self) -> None:
        """Forget what the hooks saw (a replay's forward belongs to no step's report)."""
        if self._seen:
            self._sums.zero_()
            self._seen.clear()

    def value(self) -> torch.Tensor:
        """This step's first flagged slot as a float (-1: none; 0: the input; k+1: block k), on
        device; then the flags are cleared for the next step. No sync."""
        if not self._seen:
            return self._none
        first = torch.where(torch.isfinite(self._sums), self._inf, self._codes).min()
        self.clear()  # stream-ordered after the read above
        return torch.where(torch.isfinite(first), first, self._none)

    def name(self, code: float) -> str | None:
        """The block a decoded value names ("" for the model's input), None for none."""
        k = int(code)
        if k < 0 or k > len(self.names):
            return None
        return "" if k == 0 else self.names[k - 1]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
