"""The one report layout (``ampguard.payload``): packed once on the device, cut once on the host
by its header, every reader taking its slice from it; the report built once from the parts; the
step's path carried by its ``pipeline.Decision``; the records handed to the logger through the
reporter's public ``export_pending``."""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys

import pytest
import torch

import ampguard
from ampguard.payload import HostCopy, Layout, pack
from ampguard.records import StepReport
from ampguard.stats import DECISION_K, LOCAL_K

from ._models import guarded_steps, make_data, make_model, make_opt


@pytest.mark.parametrize(("world", "norms", "numerics", "indicators"),
                         list(itertools.product([1, 3], [0, 5], [0, 4], [0, 6])))
def test_pack_then_unpack_gives_every_part_back(world, norms, numerics, indicators):
    g = torch.Generator().manual_seed(world * 100 + norms * 10 + numerics + indicators)

    def part(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    decision, gathered, n = part(DECISION_K), part(world, LOCAL_K), part(norms)
    num = part(numerics) if numerics else None
    ind = part(indicators) if indicators else None
    packed = pack(decision, gathered, n, num, ind)
    assert packed.layout == Layout(world, norms, numerics, indicators)
    assert packed.vector.numel() == packed.layout.size
    out = packed.layout.unpack(packed.vector.tolist())
    assert list(out.decision) == decision.tolist()
    assert [list(r) for r in out.rows] == gathered.tolist()
    assert list(out.norms) == n.tolist()
    assert list(out.numerics) == ([] if num is None else num.tolist())
    assert list(out.indicators) == ([] if ind is None else ind.tolist())
    # The host decision's one copy is the payload's statistics section, by the same header.
    copied = HostCopy.read(gathered, n, num, None, torch.device("cpu"), copy=True)
    assert copied.statistics is not None
    assert copied.statistics.tolist() == packed.vector[packed.layout.statistics].tolist()
    assert copied.gathered.tolist() == gathered.tolist()
    # ... and a payload built from that copy is the same vector.
    again = pack(decision, gathered, n, num, ind, copied=copied)
    assert again.layout == packed.layout and torch.equal(again.vector, packed.vector)


def test_a_payload_that_disagrees_with_its_header_is_refused():
    layout = Layout(world=2, norms=3)
    with pytest.raises(ValueError, match="layout"):
        layout.unpack([0.0] * (layout.size - 1))


def _spy_decisions(opt: ampguard.GuardedOptimizer) -> list:
    decided: list = []
    decide = opt._pipeline.decide
    opt._pipeline.decide = lambda *a, **k: decided.append(decide(*a, **k)) or decided[-1]  # type: ignore[method-assign]
    return decided


@pytest.mark.parametrize("host", [True, False])
def test_the_decision_carries_its_path(host):
    """The path (host floats or tensors) is the decision's own, set once in decide(): a stage
    never asks which object it was handed."""
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2))
    opt._pipeline.host_decision = host
    decided = _spy_decisions(opt)
    guarded_steps(opt, model, make_data(4))
    assert len(decided) == 4
    for d, report in zip(decided, opt.history):
        if host:
            assert d.host is not None and repr(d.vector.tolist()) == repr(d.host)  # NaN-safe
            assert d.skipped is report.skipped
        else:  # the tensor path; a non-fused optimizer's step read the skip (Decision.learnt)
            assert d.host is None and d.copied is None and d.skipped is report.skipped


def test_a_sampled_steps_report_is_built_once(monkeypatch):
    """Numerics, indicators and every decision field go into the one StepReport construction:
    no report is rebuilt by ``dataclasses.replace`` on the way to the host."""
    replaced: list[tuple[type, str]] = []
    replace = dataclasses.replace

    def spy(obj, /, **changes):
        replaced.append((type(obj), sys._getframe(1).f_globals["__name__"]))
        return replace(obj, **changes)

    monkeypatch.setattr(dataclasses, "replace", spy)
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16",
                        config={"numerics_every": 2, "indicators_every": 2})
    guarded_steps(opt, model, make_data(4))
    opt.flush()
    sampled = [r for r in opt.history if r.step % 2 == 0]
    assert all(r.module_grad_norms and r.grad_zero_fraction is not None for r in sampled)
    assert all(r.module_grad_norms is None and r.grad_zero_fraction is None for r in opt.history if r.step % 2)
    # (logs.Voice keeps a slimmed copy for the summary: not the report's construction)
    assert [m for t, m in replaced if t is StepReport and m != "ampguard.logs"] == []


def test_export_pending_hands_each_record_to_the_listener_then_the_exporters_once():
    class Keep:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def open(self, info) -> None: ...
        def export(self, report, anomalies) -> None:
            self.seen.append(report.step)
        def close(self) -> None: ...

    keep = Keep()
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", exporters=[keep])
    rep = opt._reporter
    report = StepReport(step=0, skipped=False, reason=None, loss=1.0, loss_scale=1.0, next_loss_scale=1.0,
                        grad_norm=math.nan, nonfinite_grads=0, nonfinite_loss=False)
    rep.record(report, [])
    heard: list[tuple[StepReport, list]] = []
    rep.export_pending(heard.extend)
    assert heard == [(report, [])] and keep.seen == [0]
    rep.export_pending(heard.extend)
    assert heard == [(report, [])] and keep.seen == [0]  # once


@pytest.mark.parametrize("kind", ["adamw", "adamw_fused"])
def test_the_cpu_payload_unpacked_on_the_host_reports_what_the_packed_one_does(kind):
    """On the CPU the host decision's payload is handed to the report as host lists
    (``payload.unpacked_on_host``), not packed by a ``cat`` and read back: the reports are the ones
    the packed payload gives, field for field, on healthy steps, a genuine fp16 overflow (the loss
    scale at 2**20, backed off step by step until the steps are taken) and every sampled part (numerics, indicators, the
    parameter check)."""
    def run(packed: bool) -> list[dict]:
        model = make_model()
        cfg = ampguard.GuardConfig(numerics_every=2, indicators_every=3, param_check_every=2, param_norms_every=1)
        opt = ampguard.wrap(make_opt(model, kind), model=model, precision="fp16", config=cfg,
                            scaler=torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3))
        if packed:  # the path every other device takes: pack(), then Layout.unpack() of the vector read back
            pipe = opt._pipeline
            pipe.payload = lambda d, g, m, *rest: pack(d.vector, g, m.norms, m.numerics, *rest)  # type: ignore[method-assign]
        guarded_steps(opt, model, make_data(12))
        opt.flush()
        return [{k: v for k, v in dataclasses.asdict(r).items() if k != "wall_time"} for r in opt.history]

    fast, slow = run(False), run(True)
    assert any(r["skipped"] for r in slow) and any(not r["skipped"] for r in slow)  # an overflow, then steps
    assert any(r["headroom_log2"] is not None for r in slow) and any(r["module_grad_norms"] for r in slow)
    assert repr(fast) == repr(slow)  # NaN-safe, field for field
