"""On CUDA: a non-fused optimizer (foreach AdamW) on the tensor decision (stop 55, ``StepPipeline.unfused_fast``).

The still-scaled gradients are measured, the decision taken in the step graph's replay (which also writes the next
scale), the skip read once (the step's one sync, where the plain loop's GradScaler reads ``found_inf``), then the
gradients unscaled by GradScaler's ``1/scale`` and stepped: bit for bit the plain GradScaler loop through genuine fp16
overflows, GradScaler's unscale kernel never run, and the same run as the host decision it replaced
(``AMPGUARD_UNFUSED_HOST_DECISION=1``). Its CPU twin: tests/unit/test_unfused_fast.py. Host time:
``benchmarks/host_time.py --host-arm``; the early skip flag (``AMPGUARD_EARLY_SKIP=1``): ``--early-arm``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard

from ..unit._models import one_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda())
            for _ in range(n)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)).cuda()


def _run(guarded: bool, batches: list, *, host: bool = False, early: bool = False) -> dict[str, Any]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the cached blocks other tests left decide where the gradients lie
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**24)  # the first steps overflow for real
    opt: Any = inner
    taken: list[int] = []
    kept: list[str | None] = []
    if guarded:
        with mock.patch.dict(os.environ, {"AMPGUARD_UNFUSED_HOST_DECISION": "1" if host else "0",
                                          "AMPGUARD_EARLY_SKIP": "1" if early else "0"}):
            opt = ampguard.wrap(inner, model=model, precision="fp16", scaler=scaler)
        pipe = opt._pipeline
        pipe._step_unscaling = lambda *a, _f=pipe._step_unscaling: taken.append(1) or _f(*a)
        rep = opt._reporter  # where each step's payload lies when the reporter gets it (a checked step's aside)
        rep.enqueue = lambda step, packed, *a, _f=rep.enqueue, **k: (
            kept.append(None if packed.layout.params else "landing" if packed.landing is not None
                        else packed.vector.device.type), _f(step, packed, *a, **k))[1]
    for x, y in batches:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        one_step(guarded, opt, scaler, loss)  # opt: the guard, or the inner optimizer itself
        opt.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"params": [p.detach().clone() for p in model.parameters()], "scale": scaler.get_scale(),
                           "taken": len(taken)}
    if guarded:
        opt.flush()
        out["skipped"] = [r.step for r in opt.history if r.skipped]
        out["reports"] = repr([(r.step, r.skipped, r.reason, r.loss, r.grad_norm, r.loss_scale, r.next_loss_scale)
                               for r in opt.history])
        out["graph"] = opt._pipeline.step_graph
        out["host"] = opt._pipeline.host_decision
        out["kept"] = kept
        out["early"] = opt._pipeline.early_skip
    return out


def test_bitwise_the_plain_loop_without_gradscalers_unscale(unscale_calls: list[int]) -> None:
    batches = _batches(24)
    plain = _run(False, batches)
    again = _run(False, batches)
    if not all(torch.equal(a, b) for a, b in zip(plain["params"], again["params"])):
        pytest.skip("the plain loop itself is not bitwise reproducible on this device")
    del unscale_calls[:]  # the plain loops' own
    got = _run(True, batches)
    assert not got["host"] and got["taken"] == len(batches) and unscale_calls == []
    assert got["scale"] == plain["scale"]
    for i, (a, b) in enumerate(zip(plain["params"], got["params"])):
        assert torch.equal(a, b), f"parameter {i} differs: max |diff| {(a - b).abs().max().item():.3e}"
    assert got["skipped"][:1] == [0]  # the first steps overflowed for real
    graphs = got["graph"]
    assert graphs.replays >= 12, (graphs.replays, graphs.captures, graphs.misses)
    # the skip read brought each step graph's payload to the host (stop 57): the reporter copies none of them
    kept = got["kept"]
    assert kept.count("cpu") >= graphs.replays - kept.count(None), kept


def test_the_same_run_as_the_host_decision_it_replaced() -> None:
    batches = _batches(24)
    host = _run(True, batches, host=True)
    tensor = _run(True, batches)
    assert host["host"] and not tensor["host"] and host["taken"] == 0
    assert tensor["reports"] == host["reports"]
    assert all(torch.equal(a, b) for a, b in zip(host["params"], tensor["params"]))


def test_the_early_skip_flag_replays_and_reads_each_steps_own_skip() -> None:
    """``AMPGUARD_EARLY_SKIP=1`` (stop 59): the step graph copies its skip flag into pinned memory and records an
    external event as soon as the rule made it, and the skip read waits on that event; at its end it copies the
    payload into pinned memory with a second event (the payload's landing). The capture takes them (no warning, the
    graph replayed), and the run is the default path's, bit for bit, through the genuine overflows of its first
    steps: each read saw its own step's flag, each report its own payload. Its CPU twin:
    tests/unit/test_early_skip.py."""
    batches = _batches(24)
    default = _run(True, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a failed capture warns, and runs eagerly for the rest of the run
        early = _run(True, batches, early=True)
    assert not [str(w.message) for w in caught if "capture" in str(w.message)]
    assert early["early"] and not default["early"]
    assert early["reports"] == default["reports"] and early["scale"] == default["scale"]
    assert all(torch.equal(a, b) for a, b in zip(default["params"], early["params"]))
    graphs = early["graph"]
    assert not graphs.failed and graphs.replays >= 12, (graphs.replays, graphs.captures, graphs.misses)
    assert early["skipped"][:1] == [0]
    # the graph landed each payload on the host itself (ampguard.payload.Landing): the reporter copies none of them
    kept = early["kept"]
    assert kept.count("landing") >= graphs.replays - kept.count(None), kept
