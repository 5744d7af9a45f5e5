"""Reliability (issue 15): restores that fail change nothing, logs that survive their own damage,
settings validated up front, steps without gradients, exporters that come back, and no side
effects on the user's process. Each test's fixture is the failing input the issue found."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

import ampguard

from ._models import guarded_steps, make_data, make_model, make_opt


# ---------------------------------------------------------------------------------- 1. atomic load_state_dict
def _fp16_guard(growth_interval: int) -> tuple[Any, torch.nn.Module]:
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2048.0, growth_interval=growth_interval)
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", scaler=scaler,
                        config={"grad_spike_factor": 10.0, "spike_warmup": 1, "escalation": {"snapshot_every": None}})
    return opt, model


def _deep(value: Any) -> Any:
    """A comparable copy: tensors as (dtype, shape, values) tuples."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().cpu().flatten().tolist())
    if isinstance(value, dict):
        return {k: _deep(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep(v) for v in value]
    return value


def _everything(opt: Any, model: torch.nn.Module) -> dict[str, Any]:
    """Every piece of state a load could touch."""
    rep, pipe, ladder = opt._reporter, opt._pipeline, opt._reporter.ladder
    scaler = opt.scaler
    return _deep({
        "params": [p.detach().clone() for p in model.parameters()],
        "inner": opt.optimizer.state_dict(),
        "scale": scaler._scale, "growth_tracker": scaler._growth_tracker,
        "scaler_cfg": [scaler._init_scale, scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval,
                       scaler._init_growth_tracker],
        "step": opt.step_count, "stage": opt._stage.value,
        "counters": [rep.skipped_total, rep.consecutive_skips, list(rep.quarantine)],
        "history": [len(rep.history), [r.step for r in rep.history], rep.history._count],
        "anomalies": [(a.step, a.kind) for a in rep.anomalies],
        "device": [pipe.scale_state.overflow_run, pipe.spikes.grad_ema, pipe.spikes.loss_ema, pipe.spikes.count],
        "ladder": ladder.state_dict(),
    })


_MISSING = object()
# Per field: values that are not what state_dict() writes. Each is tried alone.
_BAD_AMPGUARD = {
    "version": [None, 2, "1"],
    "precision": [None, "bf16", 16],
    "step": [None, "abc", -1, 1.5, True, 2**63],
    "skipped_total": [None, "1", -1, 100],
    "consecutive_skips": [None, -1, 1.0, 100],
    "overflow_run": [None, -1, "0", 2**31],
    "grad_ema": [None, "x", math.nan, math.inf, True, 10**400],
    "loss_ema": [None, "x", -math.inf, math.nan],
    "ema_count": [None, -1, 2**31, 2.0],
    "quarantine": [5, "ab", None, {"a": 1}],
    "escalation": [5, "x", [], {"recent": "x"}, {"recent": [1.5]}, {"recent": [1], "rollbacks": -1},
                   {"recent": [1], "rollbacks": 2**63}],
}
_BAD_SCALER = {
    "scale": [None, "x", True, 0.0, -1.0, math.inf, math.nan, 10**400],
    "growth_factor": [None, "x", 0.0, math.inf],
    "backoff_factor": [None, "x", 0.0, 1.5, math.nan],
    "growth_interval": [None, 0, 2.5, 2**31],
    "_growth_tracker": [None, -1, 0.5, 2**31],
}


def _cases() -> list[tuple[str, Any]]:
    cases: list[tuple[str, Any]] = []
    for top in ("optimizer", "scaler", "ampguard"):
        cases += [(f"{top} removed", (top, _MISSING)), (f"{top}=None", (top, None)), (f"{top}='x'", (top, "x"))]
    cases += [("scaler={}", ("scaler", {})),
              ("optimizer={}", ("optimizer", {})),
              ("optimizer.state removed", (("optimizer", "state"), _MISSING)),
              ("optimizer.state=[]", (("optimizer", "state"), [])),
              ("optimizer.param_groups removed", (("optimizer", "param_groups"), _MISSING)),
              ("optimizer.param_groups=[]", (("optimizer", "param_groups"), [])),
              ("optimizer.param_groups=['x']", (("optimizer", "param_groups"), ["x"]))]
    for top, table in (("ampguard", _BAD_AMPGUARD), ("scaler", _BAD_SCALER)):
        for field, values in table.items():
            cases.append((f"{top}.{field} removed", ((top, field), _MISSING)))
            cases += [(f"{top}.{field}={v!r:.30}", ((top, field), v)) for v in values]
    return cases


def _corrupt(sd: dict[str, Any], where: Any, value: Any) -> dict[str, Any]:
    sd = copy.deepcopy(sd)
    *path, last = (where,) if isinstance(where, str) else where
    target = sd
    for key in path:
        target = target[key]
    if value is _MISSING:
        del target[last]
    else:
        target[last] = value
    return sd


@pytest.fixture(scope="module")
def later_checkpoint() -> dict[str, Any]:
    """A checkpoint from further on: step 7, a grown loss scale, spike averages, a skip, a quarantine."""
    opt, model = _fp16_guard(growth_interval=2)
    data = make_data(7, seed=3)
    for i, (x, y) in enumerate(data):
        with opt.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if i == 5:
            loss = loss * math.nan
        opt.backward(loss, batch_id=f"b{i}")
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    g = sd["ampguard"]
    assert (g["step"], g["skipped_total"], g["quarantine"]) == (7, 1, ["b5"]) and g["escalation"]["recent"] == [5]
    assert sd["scaler"]["scale"] != 2048.0 and g["ema_count"] > 0
    return sd


@pytest.mark.parametrize(("case", "how"), _cases(), ids=[c for c, _ in _cases()])
def test_failed_load_state_dict_changes_nothing(later_checkpoint, case, how):
    opt, model = _fp16_guard(growth_interval=1000)
    guarded_steps(opt, model, make_data(2))
    before = _everything(opt, model)
    assert before["step"] == 2 and opt.get_scale() == 2048.0
    with pytest.raises((ValueError, TypeError), match="Nothing was loaded"):
        opt.load_state_dict(_corrupt(later_checkpoint, *how))
    assert _everything(opt, model) == before
    # and the good checkpoint still loads into the same guard afterwards
    opt.load_state_dict(copy.deepcopy(later_checkpoint))
    assert opt.step_count == 7 and opt.get_scale() == later_checkpoint["scaler"]["scale"]
