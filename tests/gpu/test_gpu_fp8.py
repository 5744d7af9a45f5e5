"""fp8 monitoring on real fp8 matmuls (torchao float8, no emulation) on CUDA: no host sync added, bitwise unchanged,
and a compiled model that does not recompile per step."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              ]

torchao_float8 = pytest.importorskip("torchao.float8")

from ampguard.fp8 import Fp8Monitor  # noqa: E402


def _model() -> torch.nn.Module:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability >= 8.9")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    return torchao_float8.convert_to_float8_training(model)


def _steps(model: torch.nn.Module, monitor: Fp8Monitor | None, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    out = []
    for step, x in enumerate(batches):
        if monitor is not None:
            monitor.begin_step(step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if monitor is not None:
            collected = monitor.collect()
            out.append(torch.cat([collected.flatten(), monitor.nonfinite(collected).reshape(1)]))
    return out


def test_monitoring_real_fp8_matmuls_adds_no_sync_and_changes_nothing():
    plain = _model()
    watched = copy.deepcopy(plain)
    monitor = Fp8Monitor(watched, numerics_every=2)
    batches = [torch.randn(64, 256, device="cuda") for _ in range(6)]
    _steps(copy.deepcopy(plain), None, batches[:1])  # warm-up (lazy init) outside the sync check
    _steps(copy.deepcopy(watched), None, batches[:1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _steps(plain, None, batches)
        rows = _steps(watched, monitor, batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), watched.state_dict().values()))
    casts = monitor.decode(rows[-1][:-1].reshape(-1, 5).tolist())
    assert len(casts) == 6 and all(c.finite for c in casts) and rows[-1][-1].item() == 0.0
    assert {c.underflow is None for c in monitor.decode(rows[-2][:-1].reshape(-1, 5).tolist())} == {False}


def test_a_nan_batch_on_cuda_is_flagged_on_device():
    model = _model()
    monitor = Fp8Monitor(model, numerics_every=1)
    x = torch.randn(64, 256, device="cuda")
    x[0, 0] = math.nan
    row = _steps(model, monitor, [x])[0]
    assert row[-1].item() == 1.0
    bad = [c for c in monitor.decode(row[:-1].reshape(-1, 5).tolist()) if not c.finite]
    assert ("0", "input") in {(c.module, c.role) for c in bad}


def test_a_compiled_monitored_model_does_not_recompile_per_step():
    from torch._dynamo.utils import counters

    model = _model()
    monitor = Fp8Monitor(model, numerics_every=2)
    compiled = torch.compile(model)
    batches = [torch.randn(64, 256, device="cuda") for _ in range(8)]
    _steps(compiled, monitor, batches[:3])  # sampled and unsampled steps both compiled
    before = dict(counters["stats"])
    rows = _steps(compiled, monitor, batches[3:])
    assert counters["stats"].get("unique_graphs", 0) == before.get("unique_graphs", 0)
    # the grad_output casts too, through the probes traced into the compiled backward (inductor)
    casts = monitor.decode(rows[-1][:-1].reshape(-1, 5).tolist())
    assert {c.role for c in casts} == {"input", "weight", "grad_output"} and all(c.finite for c in casts)


def test_the_guarded_fp8_step_adds_no_sync_and_skips_a_nan_batch_on_the_step_itself():
    import ampguard

    model = _model()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model=model, precision="bf16",
                        config={"numerics_every": 2})
    assert opt._fp8 is not None
    batches = [torch.randn(64, 256, device="cuda") for _ in range(6)]
    batches[4][0, 0] = math.nan

    def run(xs):
        for x in xs:
            with opt.autocast():
                loss = model(x).float().square().mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()

    run(batches[:1])  # warm-up (lazy init, the decision's graph capture) outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(batches[1:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reports = list(opt.history)
    assert [r.skipped for r in reports] == [False, False, False, False, True, False]
    assert reports[4].reason == "nonfinite_loss" and reports[2].fp8 is not None and reports[3].fp8 is None
    fp8 = [a for a in opt.anomalies if a.kind == "fp8_nonfinite"]
    assert len(fp8) == 1 and fp8[0].step == 4 and fp8[0].module == "0" and "0, input: amax nan" in fp8[0].detail
    opt.close()


def test_forensics_on_real_fp8_matmuls_tells_an_fp16_overflow_from_a_nan_weight():
    """tests/unit/test_fp8_forensics.py on real fp8 GEMMs (torch._scaled_mm): a layer whose fp16 output passes
    65504 is ``overflow`` (not fp8) and explains the next layer's Inf cast; a weight made NaN by a flipped bit is
    ``nan``."""
    import ampguard

    model = _model()
    with torch.no_grad():
        model[0].weight.mul_(40.0)
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.0), model=model,
                        scaler=torch.amp.GradScaler("cuda"))
    x = torch.randn(64, 256, device="cuda")
    x[2] = 6e4

    def until_found(batch):
        for _ in range(8):  # armed after the first non-finite step's report (decoded a step or two late on CUDA)
            with opt.autocast():
                loss = model(batch).float().square().mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            opt.flush()
            found = [a for a in opt.anomalies if a.kind == "fp8_nonfinite" and a.cause is not None]
            if found:
                return found[-1]
        raise AssertionError([(a.kind, a.detail) for a in opt.anomalies])

    a = until_found(x)
    assert a.module == "2" and a.cause == "overflow" and "arose at 0 (forward)" in a.detail, a.detail
    assert "finite in fp32" in a.detail and "not fp8" in a.detail
    opt.close()

    model = _model()
    with torch.no_grad():
        model[2].weight.view(torch.int32)[3, 5] |= 0x7FC00000  # a bit flip in memory: a NaN weight
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.0), model=model, precision="bf16",
                        config={"param_check_every": None})
    a = until_found(torch.randn(64, 256, device="cuda"))
    assert a.module == "2" and a.cause == "nan" and "2, weight: amax nan" in a.detail, a.detail
    opt.close()
