"""The seams between the rooms: the GradScaler adapter against the installed torch, the Backend
protocol, and the words records use."""

from __future__ import annotations

import json

import pytest
import torch

import ampguard
from ampguard.backends import Backend, LocalBackend
from ampguard.records import ANOMALY_KINDS, SKIP_REASONS, Anomaly, StepReport
from ampguard.scaling import GradScalerAdapter
from ampguard.vocab import AnomalyKind, Cause, Phase, SkipReason


def _scaled_grads(scaler: torch.amp.GradScaler) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    return model, opt


def test_grad_scaler_adapter_reads_and_writes_the_installed_torch():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    adapter = GradScalerAdapter(scaler)
    assert adapter.device_type == "cpu"
    adapter.ensure_initialized(torch.device("cpu"))
    view = adapter.view()
    assert view.scale.item() == 256.0 and view.growth_tracker.item() == 0
    assert (view.growth_factor, view.backoff_factor, view.growth_interval) == (4.0, 0.25, 7)
    model, opt = _scaled_grads(scaler)
    before = [p.grad.clone() for p in model.parameters()]
    found = adapter.unscale(object(), opt)
    assert adapter.unscaled(opt)
    assert all(torch.equal(b / 256.0, p.grad) for b, p in zip(before, model.parameters()))
    assert adapter.unscale(object(), opt) is found  # adopted, not unscaled twice
    assert all(torch.equal(b / 256.0, p.grad) for b, p in zip(before, model.parameters()))
    adapter.force_found_inf(found, torch.tensor(1.0))
    assert all(t.item() == 1.0 and t.dim() == 0 for t in found.values())
    adapter.step(opt)  # GradScaler's own step: skipped, found_inf says so
    assert all(torch.equal(b / 256.0, p.grad) for b, p in zip(before, model.parameters()))
    adapter.update(torch.tensor(64.0), torch.tensor(3, dtype=torch.int32))
    assert scaler.get_scale() == 64.0 and scaler._growth_tracker.item() == 3
    with adapter.at_scale(torch.tensor(8.0)):
        assert scaler.get_scale() == 8.0
    assert scaler.get_scale() == 64.0


def test_adapter_attach_makes_the_scalers_calls_guard_aware_and_detach_undoes_it():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    scaler = torch.amp.GradScaler("cpu")
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, scaler=scaler)
    assert {"step", "unscale_", "update", "scale"} <= set(vars(scaler))
    other_model = torch.nn.Linear(2, 2)
    other = torch.optim.SGD(other_model.parameters(), lr=0.1)
    before_other = other_model.weight.detach().clone()
    scaler.scale(other_model(torch.ones(1, 2)).sum()).backward()
    scaled = other_model.weight.grad.clone()
    with pytest.raises(ampguard.GuardStateError, match=r"no guard wraps.*ampguard.wrap\(opt1, scaler=scaler\)"):
        scaler.step(other)  # an unguarded optimizer on a guarded scaler: its overflows would never back it off
    with pytest.raises(ampguard.GuardStateError, match="no guard wraps"):
        scaler.unscale_(other)
    assert torch.equal(before_other, other_model.weight) and torch.equal(scaled, other_model.weight.grad)
    with pytest.raises(ampguard.GuardStateError, match=r"scaler.step\(opt\)"):
        scaler.step(opt.optimizer)  # the inner optimizer is the guard's too
    opt.backward(model(torch.ones(3, 4)).sum())
    opt.step()
    with pytest.raises(ampguard.GuardStateError, match=r"scaler.update\(\) after opt.step\(\)"):
        scaler.update()
    assert opt.step_count == 1 and len(opt.history) == 1
    opt.close()
    assert not {"step", "unscale_", "update", "scale", "__getstate__"} & set(vars(scaler))


def test_backend_protocol_holds_for_every_backend():
    assert isinstance(LocalBackend(), Backend)
    import torch.distributed as dist

    from ampguard.backends.torch_dist import TorchDistBackend

    with pytest.raises(ampguard.AmpGuardError, match="init_process_group"):
        TorchDistBackend()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert isinstance(TorchDistBackend(), Backend)
    finally:
        dist.destroy_process_group()
    hvd = pytest.importorskip("horovod.torch")
    from ampguard.backends.horovod import HorovodBackend

    hvd.init()
    try:
        assert isinstance(HorovodBackend(), Backend)
    finally:
        hvd.shutdown()


def test_collective_is_a_deprecated_alias_of_backend():
    model = torch.nn.Linear(2, 2)
    with pytest.warns(DeprecationWarning, match="backend="):
        opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), collective=LocalBackend())
    assert opt.backend.name == "local"
    with pytest.raises(TypeError, match="once"):
        ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), collective=LocalBackend(), backend=LocalBackend())


# The strings users see in JSONL records and Prometheus labels, as round 1 wrote them (new words
# are appended: no_gradients, issue 15).
_SEEN = {
    SkipReason: ["nonfinite_loss", "nonfinite_grad", "grad_spike", "loss_spike", "rollback", "no_gradients",
                   "nonfinite_fp8"],  # issue 28
    AnomalyKind: ["nonfinite_loss", "nonfinite_grad", "overflow", "grad_spike", "loss_spike", "scale_floor",
                  "rank_divergence", "rollback", "abort", "no_gradients", "rebaseline",
                  "nonfinite_params",  # issue 27
                  "fp8_nonfinite"],  # issue 28
    Phase: ["forward", "backward", "loss", "input"],  # "input": issue 14
    Cause: ["overflow", "nan", "transient", "fp8", "not_reproduced"],  # "not_reproduced": issue 14; "fp8": issue 28
}


@pytest.mark.parametrize("enum_cls", list(_SEEN), ids=lambda c: c.__name__)
def test_vocabulary_spells_what_users_already_see(enum_cls):
    assert [m.value for m in enum_cls] == _SEEN[enum_cls]
    for member in enum_cls:
        assert member == member.value and str(member) == member.value and f"{member}" == member.value
        assert json.dumps(member) == json.dumps(member.value)
    assert list(SKIP_REASONS) == _SEEN[SkipReason] and list(ANOMALY_KINDS) == _SEEN[AnomalyKind]


def test_records_serialise_enums_as_plain_strings():
    report = StepReport(step=1, skipped=True, reason=SkipReason.NONFINITE_GRAD, loss=1.0, loss_scale=2.0,
                        next_loss_scale=1.0, grad_norm=float("inf"), nonfinite_grads=1, nonfinite_loss=False)
    anomaly = Anomaly(1, AnomalyKind.OVERFLOW, "x", phase=Phase.BACKWARD, cause=Cause.OVERFLOW)
    text = json.dumps([report.to_dict(), anomaly.to_dict()])
    assert '"reason": "nonfinite_grad"' in text and '"kind": "overflow"' in text and '"cause": "overflow"' in text
    assert type(report.to_dict()["reason"]) is str and type(anomaly.to_dict()["phase"]) is str
