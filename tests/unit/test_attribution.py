"""Attribution by construction: a gradient's norm keeps its parameter's name through every
grouping, whatever has no gradient on a step (frozen layers, branches not taken), across
param groups and dtypes."""

from __future__ import annotations

import math

import pytest
import torch

import ampguard
from ampguard import faults


class TwoHeads(torch.nn.Module):
    """side -> body -> head, plus a branch taken only when asked (unused on other steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.side = torch.nn.Linear(4, 4)
        self.body = torch.nn.Linear(4, 4)
        self.branch = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, take_branch: bool = False) -> torch.Tensor:
        h = self.body(self.side(x))
        if take_branch:
            h = self.branch(h)
        return self.head(h)


def _step(opt, model, **kw):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(opt.step_count))
    opt.backward(model(x, **kw).square().mean())
    opt.step()
    opt.zero_grad()
    return opt.last_report


def _norms(opt, report):
    assert report.param_norms is not None and len(report.param_norms) == len(opt.param_names)
    return dict(zip(opt.param_names, report.param_norms))


def test_frozen_and_unused_parameters_do_not_shift_the_blame():
    torch.manual_seed(0)
    model = TwoHeads()
    model.side.requires_grad_(False)  # a frozen layer, as in a partial fine-tune
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters()), model=model, precision="bf16",
                        config=ampguard.GuardConfig(param_norms_every=1))
    faults.inject(opt, model, faults.grad("head.weight", "inf", steps=[1]))
    _step(opt, model)
    report = _step(opt, model)  # step 1: inf in head.weight; side frozen, branch unused
    norms = _norms(opt, report)
    assert math.isinf(norms["head.weight"])
    assert all(math.isnan(norms[n]) for n in ("side.weight", "side.bias", "branch.weight", "branch.bias"))
    assert all(math.isfinite(norms[n]) for n in ("body.weight", "body.bias", "head.bias"))
    (anomaly,) = [a for a in opt.anomalies if a.step == 1]
    assert anomaly.params == ("head.weight",) and "head.weight" in anomaly.detail
    # the branch taken: its gradients are named as its own
    norms = _norms(opt, _step(opt, model, take_branch=True))
    assert math.isfinite(norms["branch.weight"]) and math.isnan(norms["side.weight"])


def test_several_param_groups_and_mixed_dtypes_keep_their_names():
    torch.manual_seed(0)
    model = TwoHeads()
    model.body.to(torch.bfloat16)  # bf16 and fp32 parameters: grouped apart by (device, dtype)
    groups = [{"params": [model.head.weight, model.body.weight], "lr": 1e-3},
              {"params": [model.side.weight, model.side.bias, model.body.bias, model.head.bias], "lr": 1e-4},
              {"params": [model.branch.weight, model.branch.bias], "lr": 1e-4}]
    opt = ampguard.wrap(torch.optim.SGD(groups), model=model, precision="bf16",
                        config=ampguard.GuardConfig(param_norms_every=1))
    assert opt.param_names == ("head.weight", "body.weight", "side.weight", "side.bias", "body.bias", "head.bias",
                               "branch.weight", "branch.bias")
    faults.inject(opt, model, faults.grad("body.bias", "nan", steps=[0]))

    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    opt.backward(loss)
    expected = {n: p.grad.float().norm().item() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    norms = _norms(opt, opt.last_report)
    assert math.isnan(norms["body.bias"]) and opt.anomalies[-1].params == ("body.bias",)
    for name, value in expected.items():
        if name != "body.bias":
            assert norms[name] == pytest.approx(value, rel=1e-2), name  # each norm under its own name
    assert math.isnan(norms["branch.weight"]) and math.isnan(norms["branch.bias"])
