"""How many device ops the tensor decision launches (stop 52), and the ops that made them fewer.

On CUDA every op of the tensor decision is a kernel of the captured step graph, about 1-2 us of device time each:
on issue 28's compiled fp8 step that was the guard's cost beside its one read of the gradients (stop 44's profile,
stop 51's census: 50 kernels besides the norms in bf16). The count is taken here on the CPU, where the same ops run
(the norms are a dot each here, one ``_foreach_norm`` on CUDA): a change that adds ops to the decision fails here,
before a device run. Cutting them must not change a bit: ``isfinite`` as ``(x - x) == 0`` is checked against
``torch.isfinite`` on every special value, and tests/unit/test_host_decision.py holds the tensor decision to the
host's."""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampguard
import ampguard.pipeline as pipeline
from ampguard.config import GuardConfig
from ampguard.ops import TensorOps, device_constants
from ampguard.payload import Layout
from ampguard.policies import SpikeState, decide
from ampguard.scale_rule import ScaleState
from ampguard.stats import Loc, local_vector

from .test_unfused_fast import _forced

NO_KERNEL = {"view", "reshape", "select", "slice", "unsqueeze", "squeeze", "expand", "as_strided", "alias", "t",
             "detach", "empty", "empty_strided", "lift_fresh", "_unsafe_view", "flatten", "scalar_tensor"}
"""Views and allocations: no kernel of their own."""


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.seq: list[str] = []
        """The same ops in the order they ran."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.ops[name] += 1
            self.seq.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(method: str, mode: _Ops) -> Iterator[list[int]]:
    """``StepPipeline.<method>`` run under ``mode`` (its ops counted) inside the block; yields a list its calls append
    to (empty: it never ran, and the count would test nothing)."""
    original = getattr(pipeline.StepPipeline, method)
    calls: list[int] = []

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        with mode:
            return original(self, *args, **kwargs)

    setattr(pipeline.StepPipeline, method, counted)
    try:
        yield calls
    finally:
        setattr(pipeline.StepPipeline, method, original)


def census_guard(precision: str, fused: bool = True) -> tuple[ampguard.GuardedOptimizer, Callable[[], None]]:
    """A guard whose steps take the tensor decision on the CPU (forced as tests/unit/test_fast_path.py does: the
    decision CUDA runs), fused AdamW over 12 gradients (``fused=False``: foreach AdamW, on the path CUDA takes for
    it, forced as tests/unit/test_unfused_fast.py does), and its training step, after 5 steps. Also
    benchmarks/results/cpu_stop51/decision_ops.py's (the census by aten op)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])  # 12 gradients
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused else {"foreach": True}))
    guard = ampguard.wrap(inner, model=model, precision=precision, scaler=scaler)
    if fused:
        guard._pipeline.host_decision, guard._lagged_reports = False, True  # the tensor (CUDA) decision, on the CPU
    else:
        _forced(guard, step_graph=False)  # CUDA's choices for a non-fused optimizer
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype):
            loss = model(torch.randn(4, 32)).float().pow(2).mean()
        guard.backward(loss)
        guard.step()
        guard.zero_grad()

    for _ in range(5):
        step()
    return guard, step


def _decision_ops(precision: str, method: str, fused: bool = True) -> collections.Counter[str]:
    """The ops of one step's tensor decision (``method``) (:func:`census_guard`); the norms' own ops (a dot per
    gradient, their stack and sqrt) taken out."""
    guard, step = census_guard(precision, fused)
    mode = _Ops()
    try:
        with counting(method, mode) as calls:
            step()
    finally:
        guard.close()
    assert calls, f"{method} did not run: the count would test nothing"
    ops = mode.ops
    assert ops["dot"] == 12  # the norms, then taken out with their stack and sqrt
    ops["dot"] = 0
    ops["stack"] -= 1
    ops["sqrt_"] -= 1
    return +ops


@pytest.mark.parametrize(("precision", "method", "fused", "most"), [
    # 453fd82: 50 (7 where, 6 or, 5 gt, 3 isfinite of 4 ops, 4 constants...); 8b9ae21: 27 (stop 58: the decision
    # vector's values and tail in one stack)
    ("bf16", "_through_unscaled", True, 26),
    # 453fd82: 87; ece8b69: 62 (stop 58: hysteresis 1, the default, in one op where the general rule takes five; the
    # one stack above)
    ("fp16", "_through_decision", True, 57),
    # a non-fused step unscales by the 1/scale the norms were multiplied by (stop 58; 1c330ae: 64, a second
    # inv_scale's three ops for it: to float64, reciprocal, to float32), and the two cuts above
    ("fp16", "_through_decision", False, 56),
])
def test_the_tensor_decision_launches_few_ops(precision, method, fused, most):
    ops = _decision_ops(precision, method, fused)
    total = sum(ops.values())
    assert total <= most, f"{precision}: {total} ops besides the norms (at most {most}): {dict(ops)}"
    # no constant made inside the step: ops.device_constants keeps them per device
    assert ops["zeros"] == ops["ones"] == ops["full"] == 0, dict(ops)
    assert ops["abs"] == 0, dict(ops)  # torch.isfinite's four kernels are (x == x) * (x.abs() != inf)


SPECIAL = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.17549435e-38,
           3.4028234663852886e38, -3.4028234663852886e38, 1.0, -2.5, 65504.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_isfinite_by_subtraction_is_torch_isfinite(dtype):
    x = torch.tensor(SPECIAL, dtype=torch.float32).to(dtype)
    o = TensorOps(torch.device("cpu"))
    assert torch.equal(o.isfinite(x), torch.isfinite(x))
    assert torch.equal(o.nonfinite(x), ~torch.isfinite(x))


def test_the_constants_are_made_once_and_never_written():
    cpu = torch.device("cpu")
    o, c = TensorOps(cpu), device_constants(cpu)
    assert TensorOps(cpu).one is o.one is c.one and o.false is c.false and o.nan is c.nan and o.inf is c.inf
    before = [t.clone() for t in c]
    # a decision and the local vector's device pack, on a NaN step and on a healthy one: every constant read, none
    # written
    for g in ([1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, -1.0, math.nan, 0.0, 0.0],
              [math.nan, 1.0, math.inf, 3.0, 1.0, 0.0, 0.0, -1.0, math.nan, 1.0, 0.0]):
        decide(torch.tensor([g]), config=GuardConfig(), spikes=SpikeState.fresh(cpu),
               scale_state=ScaleState(torch.zeros((), dtype=torch.int32)), scaler=None, grads_sharded=False)
        local_vector(loss=torch.tensor(g[0]), tensor_norms=torch.tensor(g[2:4]), found_inf=None, pre_reduction=None,
                     device=cpu, host=False)
    assert all(torch.equal(a, b) or (a.isnan() and b.isnan()) for a, b in zip(before, device_constants(cpu)))


def test_the_local_vector_counts_non_finite_norms_as_before():
    norms = torch.tensor([1.0, math.nan, math.inf, 0.0, 3.4028234663852886e38], dtype=torch.float32)
    vec = local_vector(loss=torch.tensor(math.inf), tensor_norms=norms, found_inf=None, pre_reduction=None,
                       device=torch.device("cpu"), host=False)
    assert vec[Loc.NONFINITE_TENSORS].item() == 2.0 and vec[Loc.LOSS_NONFINITE].item() == 1.0
    assert vec.dtype == torch.float32


def test_the_early_skip_flag_comes_before_most_of_the_step_graph():
    """With ``AMPGUARD_EARLY_SKIP`` the skip read waits for the ops up to the flag's copy only (stop 59: 37 of the fp16
    foreach step graph's 72 here with the flag's and the landing's copies, the 12 dots one ``_foreach_norm`` on CUDA;
    benchmarks/results/cpu_stop59/early_census.py): a change that makes the flag later, or the graph longer before
    it, fails here before a device run shows the wait grow."""
    guard, step = census_guard("fp16", fused=False)
    pipe = guard._pipeline
    mode = _Ops()
    seen: list[int] = []

    class Event:  # the flag's external event: notes how many ops ran before its record
        def record(self) -> None:
            seen.append(sum(mode.ops.values()))

        def synchronize(self) -> None:
            pass

    flag, event = torch.zeros(1, dtype=torch.bool), Event()
    pipe.early_skip, pipe._new_flag = True, lambda: (flag, event)
    buf, landed = torch.zeros(Layout(1, 12).size), Event()  # census_guard's 12 gradients; made outside the count
    pipe._new_slot = lambda size: (buf, landed)
    try:
        with counting("_through_decision", mode) as calls:
            step()
    finally:
        guard.close()
    assert calls
    total = sum(mode.ops.values())
    assert len(seen) == 2, seen  # the flag's record, then the payload's landing at the graph's end
    before, landing = seen
    assert total - landing <= 2, (landing, total)  # the landing's copy: after the payload, before the scale's writes
    assert before <= 37 and total - before >= 30, (before, total, dict(mode.ops))


def test_constants_first_made_inside_a_compile_trace_are_not_kept_and_ask_no_capture(compile_state, monkeypatch):
    # stop 65, on an H100: the fused rule (AMPGUARD_FUSED_RULE) compiles the step's tail on the first step of a
    # process, before any eager step made the device's constants; device_constants then ran inside the trace and asked
    # torch.cuda.is_current_stream_capturing(), a query returning a bool that dynamo cannot trace: the compile failed,
    # the guard warned and took the rule op by op. Inside a trace the constants are now the compiled code's own: not
    # kept (a trace's tensors are not the eager ones a later step reads), and no capture query asked. Here the CUDA
    # query is stood in for by a function dynamo must not trace (dynamo.disable: calling it under fullgraph fails)
    from ampguard import ops

    cpu = torch.device("cpu")
    asked: list[torch.device] = []

    @torch._dynamo.disable
    def query(device: torch.device) -> bool:
        asked.append(device)
        return False

    monkeypatch.setattr(ops, "_CONSTANTS", {})
    monkeypatch.setattr(ops, "capturing", query, raising=False)  # (raising=False: the name is new)
    traced = torch.compile(lambda x: x * ops.device_constants(cpu).one + ops.device_constants(cpu).zero,
                           fullgraph=True, backend="eager")
    assert torch.equal(traced(torch.tensor([2.0, -3.0])), torch.tensor([2.0, -3.0]))
    assert not asked and cpu not in ops._CONSTANTS  # before: stored from inside the trace
    kept = ops.device_constants(cpu)  # an eager call makes them, asks, and keeps them
    assert asked == [cpu] and ops._CONSTANTS[cpu] is kept and ops.device_constants(cpu) is kept
