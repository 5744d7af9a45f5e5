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

The model's output is read through the loss (``"top"`` only). The last top block of a language model is its head,
whose output is the logits: on GPT-2 124M at batch 8, 824 MB, whose sum was most of what the sentinel cost
(benchmarks/RESULTS.md, stop 61). The loss reads every logit already, and the guard checks the loss. So once the
last block's output has been seen to be the model's own output (a forward hook on the model compares the tensors)
and the guard has been given the loss, that output is not summed: the step's value then says so (``UNREAD``), and a
non-finite loss on a step where every watched block's output was finite names the last block, as "that block or
the loss computed from it". Where the output is not the model's (a head whose output something else consumes), it
is summed when the model's forward returns, as before. Left out: a logit of ``-inf`` leaves a softmax cross-entropy
finite, and a NaN logit at an ignored position (``ignore_index``) can leave the loss finite while the gradients are
not; such a step is still skipped and reported, without the sentinel's name (as without a sentinel).

Batched (``AMPGUARD_SENTINEL_BATCH=1``, off by default; CUDA only, :data:`BATCH_DEVICES`): the outputs are held until
the model's forward returns, then read by one ``_foreach_norm(ord=1)`` per dtype (the sum of absolute values: NaN and
inf propagate as in the sum, and so does a float32 overflow of finite values) and added into their slots by one
``_foreach_add_``, where each output took a sum and a memset of its semaphores: on an H100 (stop 65,
``benchmarks/results/gpu_stop65/sentinel_kernels.txt``) GPT-2 124M's 15 float32 sums read 25 MB each at ~2.1 TB/s
(178 us a step) where the memory gives 3.35. An output that autograd does not keep (an embedding's, before it is
added) then lives to the forward's end. Not inside a ``torch.compile`` trace (its sums stay in the graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..module_hooks import Hook
from ..ops import TensorOps
from ..switches import implementation_switches
from .compile import named_user_modules, user_module

__all__ = ["BATCH_DEVICES", "Sentinel", "top_blocks", "UNREAD"]

BATCH_DEVICES: tuple[str, ...] = ("cuda",)
"""Devices whose sentinel batches its reads when ``AMPGUARD_SENTINEL_BATCH=1`` (the module docstring): CUDA, where
``_foreach_norm`` has its multi-tensor kernel; on the CPU it is a loop of single norms, and each output is summed as
it comes (the tests add the CPU to check the batched path's names)."""

UNREAD = -2.0
"""A step's value when no watched block was non-finite and the last block's output was read through the loss only."""

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
        self._unread = torch.full((), UNREAD, dtype=torch.float32, device=device)
        self._tail = len(names) if spec == "top" and len(names) > 1 else None
        """The last block's slot, whose output may be read through the loss (None: every output summed)."""
        self.loss_given = False
        """Set by the guard at each step: it was given this step's loss (``observe_loss`` or ``backward``)."""
        self._tail_is_output = False  # learned: the last forward returned the last block's output as the model's
        self._held: torch.Tensor | None = None  # the last block's output in this forward, until the model returns
        self._skipped_now = False  # this forward did not sum it
        self._unread_step = False  # a forward of this step did not sum it, and it was the model's output
        self.batched = implementation_switches().sentinel_batch and device.type in BATCH_DEVICES
        """Outputs held and read together when the model returns (``AMPGUARD_SENTINEL_BATCH``), not one by one."""
        self._pending: list[tuple[int, torch.Tensor]] = []  # batched: this forward's (slot, output)s not yet read
        self._handles: list[Any] = [root.register_forward_pre_hook(Hook(self._input_hook), prepend=True)]
        for k, name in enumerate(names):
            self._handles.append(table[name].register_forward_hook(Hook(self._output_hook(k + 1))))
        if self._tail is not None or self.batched:
            self._handles.append(root.register_forward_hook(Hook(self._returned)))

    def _input_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled():
            self.flush()  # batched: an earlier forward that did not return (it raised): what it held is read now
            self._held, self._skipped_now = None, False
            x = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            if x is not None:
                self._mark(0, x)

    def _returned(self, module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
        """The model's forward returned: was the last block's output its output? If not, and it went unsummed, sum it
        now (the tensor is still alive: held since the block's hook)."""
        held, self._held = self._held, None
        if held is not None and torch.is_grad_enabled():
            self._tail_is_output = _returns(out, held)
            if self._skipped_now:
                self._skipped_now = False
                if self._tail_is_output:
                    self._unread_step = True
                else:
                    assert self._tail is not None  # internal: held only with a tail
                    self._mark(self._tail, held)
        self.flush()

    def _output_hook(self, slot: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if not torch.is_grad_enabled():
                return
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                if slot == self._tail:
                    if self._skipped_now and self._held is not None:  # called again in this forward: the earlier
                        self._mark(slot, self._held)  # output is not the one the model returns
                    self._held, self._skipped_now = t, False  # compared with the model's output by identity
                    if self.loss_given and self._tail_is_output:  # read through the loss: see the module docstring
                        self._skipped_now = True
                        return
                self._mark(slot, t)

        return hook

    def _mark(self, slot: int, t: torch.Tensor) -> None:
        t = t.detach()
        if t.device != self.device:  # e.g. a CPU tensor in a CUDA model: copied, still no sync
            t = t.to(self.device, non_blocking=True)
        # held only in a forward: a block recomputed inside backward (activation checkpointing) is summed as it comes,
        # or its output would be held past the backward, to the step
        if (self.batched and t.dim() and not torch.compiler.is_compiling()
                and torch._C._current_graph_task_id() == -1):
            # a block called twice in one forward: one add per slot and batch
            if any(k == slot for k, _ in self._pending):
                self.flush()
            self._pending.append((slot, t))
            return
        if t.dtype is torch.bfloat16 and t.device.type == "cpu":
            # the CPU's sum to float32 first copies the whole tensor to float32 (CUDA's reads bf16 and fp16 as they
            # are); its bf16 sum accumulates in float32 without the copy (5-7x faster: cpu_stop64) and keeps (all but)
            # float32's range: a sum non-finite in float32 is non-finite here (fp16's range would not do: fp16 keeps
            # the copy)
            t = t.sum()
        if slot in self._seen:  # a second forward in this step (accumulation): add its sum
            self._slots[slot].add_(t.sum(dtype=torch.float32))
        elif t.dim():  # one reduction kernel, straight into the step's buffer
            torch.sum(t, dim=tuple(range(t.dim())), dtype=torch.float32, out=self._slots[slot])
            self._seen.add(slot)
        else:
            self._slots[slot].copy_(t)
            self._seen.add(slot)

    def flush(self) -> None:
        """Batched: read the held outputs into their slots, one ``_foreach_norm`` per dtype and one ``_foreach_add_``
        each (the module docstring), and let go of them. No sync."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for slot, t in pending:
            by_dtype.setdefault(t.dtype, []).append((slot, t))
        for group in by_dtype.values():
            norms = torch._foreach_norm([t for _, t in group], 1, dtype=torch.float32)
            torch._foreach_add_([self._slots[slot] for slot, _ in group], norms)
        self._seen.update(slot for slot, _ in pending)

    def clear(self) -> None:
        """Forget what the hooks saw (a replay's forward belongs to no step's report)."""
        self._pending = []
        self._unread_step = False
        if self._seen:
            self._sums.zero_()
            self._seen.clear()

    def value(self) -> torch.Tensor:
        """This step's first flagged slot as a float (-1: none; :data:`UNREAD`: none, and the last block's output
        read through the loss only; 0: the input; k+1: block k), on device; then the flags are cleared for the next
        step. No sync."""
        self.flush()  # batched: a forward whose model's hook did not run (its blocks called directly)
        none = self._unread if self._unread_step else self._none
        if not self._seen:
            self._unread_step = False
            return none
        # TensorOps.isfinite: two kernels where torch.isfinite is four; first is a slot's code or inf, never NaN, so one
        # comparison with inf tells which
        first = torch.where(TensorOps.isfinite(self._sums), self._inf, self._codes).min()
        self.clear()  # stream-ordered after the read above
        return torch.where(first < self._inf, first, none)

    @property
    def last(self) -> str:
        """The last watched block (the one :data:`UNREAD` refers to)."""
        return self.names[-1]

    def name(self, code: float) -> str | None:
        """The block a decoded value names ("" for the model's input), None for none."""
        k = int(code)
        if k < 0 or k > len(self.names):
            return None
        return "" if k == 0 else self.names[k - 1]

    def remove(self) -> None:
        self._held = None
        self._pending = []
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _returns(out: Any, t: torch.Tensor, depth: int = 2) -> bool:
    """Whether the model's output ``out`` is ``t`` or holds it (in a tuple, a list or a mapping such as
    ``transformers``' ``ModelOutput``, two levels down at most), the same tensor object. A copy (accelerate's
    ``convert_outputs_to_fp32`` returns the logits in float32) is not: that block's output is then summed."""
    if isinstance(out, torch.Tensor):
        return out is t
    if depth <= 0:
        return False
    if isinstance(out, dict):
        out = list(out.values())
    return isinstance(out, (tuple, list)) and any(_returns(o, t, depth - 1) for o in out)
