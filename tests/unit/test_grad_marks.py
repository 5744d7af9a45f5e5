"""The gradients' marks (``pipeline.grad_marks``, ``pipeline.marks_after_step``): which gradient tensor each
parameter holds and its autograd version counter, by which the guard tells a fresh backward from a stale step.
``marks_after_step`` reads them from the step's grouping instead of ``.grad``: both against the plain definition
on every shape of grouping (all present, some missing, several (device, dtype) groups, none), and as a backward
moves them. (Stop 39 tried one-pass-in-C forms of both: no faster, 50 -> 55 and 34 -> 32 us at 292 parameters.)"""

from __future__ import annotations

import torch

from ampguard.pipeline import grad_marks, marks_after_step
from ampguard.stats import grads_by_device_and_dtype


def _definition(params: list[torch.Tensor]) -> list[object]:
    return [None if p.grad is None else (id(p.grad), p.grad._version) for p in params]


def _params(dtypes: list[torch.dtype], missing: tuple[int, ...] = ()) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros(3, dtype=dt)) for dt in dtypes]
    for i, p in enumerate(params):
        if i not in missing:
            p.grad = torch.ones(3, dtype=p.dtype)
    return params


def test_marks_are_the_definitions_on_every_grouping() -> None:
    f32, f64 = torch.float32, torch.float64
    cases = [_params([f32] * 5), _params([f32] * 5, missing=(0, 3)), _params([f32] * 5, missing=(4,)),
             _params([f32, f64, f32, f64, f32]), _params([f64, f32, f32], missing=(1,)), _params([f32] * 3, (0, 1, 2))]
    for params in cases:
        want = _definition(params)
        assert grad_marks(params) == want
        assert marks_after_step(grads_by_device_and_dtype(params), params) == want


def test_marks_move_with_a_backward_and_with_new_tensors() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    params = list(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    before = marks_after_step(grads_by_device_and_dtype(params), params)
    assert before == grad_marks(params) == _definition(params)
    model(torch.ones(2, 4)).sum().backward()  # accumulated in place: the versions move
    assert grad_marks(params) != before and grad_marks(params) == _definition(params)
    for p in params:
        p.grad = None
    model(torch.ones(2, 4)).sum().backward()  # new tensors
    assert grad_marks(params) == _definition(params)
