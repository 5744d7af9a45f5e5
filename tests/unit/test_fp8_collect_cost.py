"""What the fp8 monitor's step costs the host: :meth:`Fp8Monitor.collect` and :meth:`Fp8Monitor.nonfinite` run in
``step()`` on every step, each of their ops a kernel launch. On an H100's host (stop 44, call b,
``benchmarks/results/gpu_stop44_b/host_time_ops.txt``) an op there cost ~25 us, and these two made 27 ops a step where
CUDA's autocast rounds the inputs (counted on the CPU with that rounding set; 23 kernels without it, as here): most of
the 1.1 ms the guard added to ``step()`` on the fp8 MLP. Real torchao float8 (CPU: ``emulate=True``)."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

torchao_float8 = pytest.importorskip("torchao.float8")

from ampguard.fp8 import Fp8Monitor  # noqa: E402
from tests.unit.test_fp8 import _model, spy_over_the_taps  # noqa: E402  (_model: 16 -> 32 -> 16)
from tests.unit.test_fp8_sample import _VIEWS  # noqa: E402

_HOST_ONLY = _VIEWS | {"select", "unsqueeze", "lift_fresh"}
"""Ops that run no kernel: views, and ``torch.tensor``'s lift of a new constant."""


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).split(".")[1]
        if name not in _HOST_ONLY:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _kernels(step: int) -> tuple[int, float]:
    """Kernels collect() and nonfinite() run after a step (after a first step, so the monitor's constants exist),
    and the flag."""
    model = _model()
    monitor = Fp8Monitor(model, numerics_every=10)
    x = torch.randn(8, 16)
    for s in (step, step):
        monitor.begin_step(s)
        model(x).square().mean().backward()
        with _Ops() as ops:
            flag = monitor.nonfinite(monitor.collect())
    return sum(ops.ops.values()), flag.item()


@pytest.mark.parametrize("step, most", [(1, 10), (0, 36)], ids=["unsampled", "sampled"])
def test_a_step_collects_the_casts_in_a_few_kernels(step: int, most: int) -> None:
    """Unsampled: the amaxes stacked, torchao's scale from them (4: float64, clamp, divide, float32), the rows
    stacked; the flag from the amaxes (4: ``amax - amax``, ``ne``, ``any``, float32). Sampled: every cast's
    statistics measured at once from the samples the taps copied into one buffer (``|x|`` against each cast's exact
    threshold, the zeros, the smallest; the amaxes and scales stacked; the rows stacked), and the flag. Before stop
    44, here: 23 and 19 (the flag read the order and the scale too, each by several ops); until stop 49 a sampled
    step's collect() ran 6, each cast having run ~27 of its own (below)."""
    kernels, flag = _kernels(step)
    assert kernels <= most, kernels
    assert flag == 0.0


def test_a_layer_that_did_not_run_is_not_a_nonfinite_cast() -> None:
    """A Float8Linear no forward reached (its three casts absent: order NaN, amax 0) beside a NaN elsewhere, and
    without it: the flag is the NaN's alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(16, 32))
    model.add_module("unused", torch.nn.Linear(32, 32))
    model = torchao_float8.convert_to_float8_training(model, config=torchao_float8.Float8LinearConfig(emulate=True))
    model.forward = lambda x: model.fc1(x)  # type: ignore[method-assign]  (the unused layer is never called)
    for step in (1, 0):  # unsampled, sampled
        for bad in (None, math.nan):
            x = torch.randn(8, 16)
            if bad is not None:
                x[2, 3] = bad
            monitor = Fp8Monitor(model, numerics_every=10)
            monitor.begin_step(step)
            model(x).square().mean().backward()
            rows = monitor.collect()
            assert monitor.nonfinite(rows).item() == (0.0 if bad is None else 1.0), (step, bad)
            casts = monitor.decode(rows.tolist())
            assert [(c.module, c.role) for c in casts][:2] == [("fc1", "input"), ("fc1", "weight")]
            assert {c.module for c in casts} == {"fc1"}
            monitor.close()
            model.zero_grad()


def _deep(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
    return torchao_float8.convert_to_float8_training(model, config=torchao_float8.Float8LinearConfig(emulate=True))


def _step_kernels(layers: int, monitored: bool, step: int = 1) -> int:
    """Kernels of one step (unsampled; ``step`` 0: sampled): forward, backward, and with a monitor its collect() and
    nonfinite(), of a ``layers``-deep float8 model fed bfloat16, as CUDA's autocast feeds torchao: its input and
    grad_output casts are of bfloat16 tensors, torchao's amaxes of them bfloat16 (the weights' float32)."""
    model = _deep(layers)
    monitor = Fp8Monitor(model, numerics_every=10) if monitored else None
    x = torch.randn(8, 16).bfloat16()
    kernels = 0
    for _ in range(2):  # the second step, the monitor's constants made
        if monitor is not None:
            monitor.begin_step(step)
        with _Ops() as ops:
            model(x).float().square().mean().backward()
            if monitor is not None:
                monitor.nonfinite(monitor.collect())
        kernels = sum(ops.ops.values())
        model.zero_grad(set_to_none=True)
    if monitor is not None:
        monitor.close()
    return kernels


def test_an_unsampled_steps_kernels_do_not_grow_with_the_casts():
    """What an unsampled step adds to the unmonitored step's kernels is collect()'s few, however many casts: the
    amaxes are torchao's, kept in the dtype torchao reduced them in and converted in one kernel per dtype. Until stop
    49 each bfloat16 amax was converted to float32 as it was taken: 96 kernels a step on GPT-2 124M fp8 (an H100's
    profile, ``benchmarks/results/gpu_stop49/``), one launch each on the host."""
    added = {n: _step_kernels(n, True) - _step_kernels(n, False) for n in (2, 8)}
    assert added[8] == added[2] <= 16, added


def test_amaxes_of_two_dtypes_come_back_in_slot_order_bitwise(monkeypatch):
    """The bfloat16 amaxes (inputs, grad_outputs) and the float32 ones (weights), grouped by dtype as taken and put
    back in slot order: bitwise the rows of a monitor whose hooks measure every cast themselves (someone else's
    patch over torchao's cast, as in tests/unit/test_fp8.py), with a NaN in the batch, and with a layer that did not
    run (its slots: order NaN, amax 0)."""
    x = torch.randn(8, 16).bfloat16() * 3
    for bad in (None, math.nan):
        if bad is not None:
            x[3, 5] = bad
        rows = []
        for spied in (False, True):
            model = _deep(3)
            model.forward = lambda x, m=model: m[1](m[0](x))  # type: ignore[method-assign]  (m[2] never runs)
            monitor = Fp8Monitor(model, numerics_every=10)
            if spied:
                spy_over_the_taps(monkeypatch)
            monitor.begin_step(1)
            model(x).float().square().mean().backward()
            kinds = {t.dtype for t in monitor._slots if t is not None}
            assert kinds == ({torch.float32} if spied else {torch.bfloat16, torch.float32})
            rows.append(monitor.collect())
            assert monitor.nonfinite(rows[-1]).item() == (bad is not None)
            monitor.close()
            monkeypatch.undo()
        assert torch.equal(rows[0].nan_to_num(7.0), rows[1].nan_to_num(7.0)), rows
        assert rows[0][6:, 0].isnan().all() and rows[0][6:, 1].eq(0).all() and rows[0][:6, 0].ge(1).all()


def test_a_sampled_tensorwise_cast_runs_one_kernel():
    """A sampled step adds one kernel a tensorwise cast over the unmonitored step (its row sample copied into the
    step's buffer; torchao's own amax and scale) and collect()'s, which do not grow with the casts. Until stop 49:
    26-27 a cast (:func:`cast_stats` whole, its amax and scale measured again), ~4500 launches a sampled step on
    GPT-2 124M fp8, ~70 ms of an H100's host time; then 8 a cast, 7 since stop 50 (``fp8._Sampled``, still the
    rowwise recipe's)."""
    added = {n: _step_kernels(n, True, step=0) - _step_kernels(n, False, step=0) for n in (2, 8)}
    per_cast = (added[8] - added[2]) / (3 * (8 - 2))
    assert per_cast <= 1 and added[2] - 3 * 2 <= 45, (per_cast, added)
