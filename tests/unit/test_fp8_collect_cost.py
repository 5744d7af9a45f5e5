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
from tests.unit.test_fp8 import _model  # noqa: E402  (16 -> 32 -> 16)
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


@pytest.mark.parametrize("step, most", [(1, 10), (0, 6)], ids=["unsampled", "sampled"])
def test_a_step_collects_the_casts_in_a_few_kernels(step: int, most: int) -> None:
    """Unsampled: the amaxes stacked, torchao's scale from them (4: float64, clamp, divide, float32), the rows
    stacked; the flag from the amaxes (4: ``amax - amax``, ``ne``, ``any``, float32). Sampled: the rows stacked, the
    order column joined, and the flag. Before stop 44, here: 23 and 19 (the flag read the order and the scale too,
    each by several ops)."""
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
