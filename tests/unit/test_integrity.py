"""Issue 27: a health verdict for checkpoints, poison refused on load, non-finite weights caught at
once. Real failures: AdamW with eps=0 on a gradient that is exactly zero (0/0), an LR schedule that
reaches inf, a NaN written into a real checkpoint file, a bit flipped through an integer view."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard
from ampguard.fingerprint import param_fingerprints


class _Gated(nn.Module):
    """A tiny MLP with a parameter the loss never reaches: its gradient is exactly zero."""

    def __init__(self, sizes: tuple[int, int, int, int] = (8, 16, 2, 3)) -> None:  # in, hidden, out, gate
        super().__init__()
        d_in, hidden, d_out, gate = sizes
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
        self.gate = nn.Parameter(torch.zeros(gate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + 0 * self.gate.sum()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)


def _train(opt: ampguard.GuardedOptimizer, model: nn.Module, steps: int) -> None:
    x, y = _data()
    for _ in range(steps):
        with opt.autocast():
            loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()


def _guard(model: nn.Module, inner: torch.optim.Optimizer | None = None, **config: object) -> ampguard.GuardedOptimizer:
    inner = inner if inner is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ampguard.wrap(inner, model=model, precision="bf16", config=ampguard.GuardConfig(**config))


def test_adamw_eps0_on_a_zero_gradient_is_caught_on_its_step_and_named():
    torch.manual_seed(0)
    model = _Gated()
    opt = _guard(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0), param_check_every=1)
    with pytest.raises(ampguard.NonFiniteError, match="gate") as err:
        _train(opt, model, 5)
    assert torch.isnan(model.gate).all()  # a real 0/0: exp_avg / (sqrt(exp_avg_sq) + 0)
    (anomaly,) = [a for a in opt.anomalies if a.kind == "nonfinite_params"]
    assert anomaly.step == 0 and anomaly.params == ("gate",) and "from finite gradients" in anomaly.detail
    assert opt.step_count == 1 and "step 0" in str(err.value)
    verdict = opt.verify()
    assert not verdict.healthy and "gate" in verdict.nonfinite and not verdict.last_step_finite


def test_the_check_runs_every_n_steps_and_can_be_switched_off():
    torch.manual_seed(0)
    model = _Gated()
    opt = _guard(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0), param_check_every=3)
    with pytest.raises(ampguard.NonFiniteError):
        _train(opt, model, 5)
    assert [a.step for a in opt.anomalies if a.kind == "nonfinite_params"] == [0]
    torch.manual_seed(0)
    model = _Gated()
    opt = _guard(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0), param_check_every=None,
                 max_consecutive_skips=None)
    _train(opt, model, 3)  # off: nothing names the weights (the losses after step 0 are finite: gate is unused)
    assert not [a for a in opt.anomalies if a.kind == "nonfinite_params"]
    with pytest.raises(ValueError, match="param_check_every"):
        ampguard.GuardConfig(param_check_every=0)


def test_an_lr_schedule_that_reaches_inf_rolls_back_with_the_ladder():
    torch.manual_seed(0)
    model = _Gated()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: math.inf if step == 3 else 1.0)
    ladder = ampguard.Escalation(snapshot_every=1, rollback_after=1, max_rollbacks=2)
    opt = ampguard.wrap(inner, model=model, precision="bf16",
                        config=ampguard.GuardConfig(param_check_every=1, escalation=ladder))
    x, y = _data()
    for _ in range(5):
        with opt.autocast():
            loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
    kinds = [(a.step, a.kind) for a in opt.anomalies]
    assert (3, "nonfinite_params") in kinds, kinds
    assert any(k == "rollback" for _, k in kinds), kinds
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the snapshot after step 2 restored


def test_verify_names_a_non_finite_optimizer_state_tensor():
    torch.manual_seed(0)
    model = _Gated()
    opt = _guard(model)
    _train(opt, model, 2)
    assert opt.verify().healthy
    state = opt.optimizer.state[model.fc1.weight]
    state["exp_avg_sq"].view(torch.int32)[0, 0] = 0x7FC00000  # a NaN, written through the integer view
    verdict = opt.verify()
    assert not verdict.healthy and verdict.nonfinite == ("optimizer.state[fc1.weight].exp_avg_sq",)
    assert "exp_avg_sq" in verdict.describe()


def test_a_flipped_bit_changes_exactly_that_parameters_fingerprint():
    torch.manual_seed(0)
    model = _Gated()
    opt = _guard(model)
    _train(opt, model, 1)
    before = opt.verify()
    with torch.no_grad():
        model.fc2.bias.view(torch.int32)[1] ^= 1 << 3  # one mantissa bit: still finite, still plausible
    after = opt.verify()
    assert after.healthy  # finite: only the fingerprint sees it
    differ = [n for n, a, b in zip(before.names, before.fingerprints, after.fingerprints) if a != b]
    assert differ == ["fc2.bias"]
    fp = param_fingerprints([torch.tensor([1.0, 2.0]), torch.tensor([2.0, 1.0])])
    assert fp[0, 0] == fp[1, 0] and fp[0, 1] != fp[1, 1]  # a swap: same sum, another weighted sum


def _checkpoint(tmp_path, poison: bool = False) -> tuple[dict, object]:
    torch.manual_seed(0)
    model = _Gated()
    opt = _guard(model)
    _train(opt, model, 3)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    assert state["opt"]["ampguard"]["verdict"]["last_step_finite"] is True
    if poison:  # a NaN in the saved optimizer state, as a corrupt replicated checkpoint carries it
        state["opt"]["optimizer"]["state"][1]["exp_avg"].view(-1)[3] = math.nan
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    return torch.load(path, weights_only=False), path


def _fresh() -> tuple[nn.Module, ampguard.GuardedOptimizer]:
    torch.manual_seed(1)
    model = _Gated()
    return model, _guard(model)


def test_a_healthy_checkpoint_round_trips_through_a_file(tmp_path):
    state, _ = _checkpoint(tmp_path)
    model, opt = _fresh()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])  # weights first: the fingerprints match
    assert opt.step_count == 3
    _train(opt, model, 1)


def test_a_non_finite_checkpoint_file_is_refused_and_nothing_changes(tmp_path):
    state, _ = _checkpoint(tmp_path, poison=True)
    model, opt = _fresh()
    model.load_state_dict(state["model"])
    _train(opt, model, 1)
    before = {k: v.clone() for k, v in opt.optimizer.state[model.fc1.weight].items()}
    with pytest.raises(ampguard.CheckpointError, match=r"optimizer state is non-finite: optimizer.state\[1\].exp_avg"):
        opt.load_state_dict(state["opt"])
    after = opt.optimizer.state[model.fc1.weight]
    assert all(torch.equal(before[k], after[k]) for k in before) and opt.step_count == 1


def test_an_unhealthy_verdict_is_refused_on_load(tmp_path):
    torch.manual_seed(0)
    model = _Gated()
    opt = _guard(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0), param_check_every=1)
    with pytest.raises(ampguard.NonFiniteError):
        _train(opt, model, 3)
    saved = opt.state_dict()
    assert saved["ampguard"]["verdict"]["nonfinite"]
    _, opt2 = _fresh()
    with pytest.raises(ampguard.CheckpointError, match="unhealthy at step 1: non-finite: gate"):
        opt2.load_state_dict(saved)
    assert opt2.step_count == 0


def test_a_skipped_overflow_leaves_a_healthy_checkpoint():
    torch.manual_seed(0)
    model = _Gated()
    opt = _guard(model)
    _train(opt, model, 2)
    x, y = _data()
    with opt.autocast():
        loss = F.cross_entropy(model(x), y) * math.inf  # a genuine non-finite loss: the step is skipped
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    verdict = opt.verify()
    assert verdict.healthy and not verdict.last_step_finite  # the skip protected the state


@pytest.mark.parametrize("weights_first", [True, False], ids=["weights-first", "optimizer-first"])
def test_the_weights_are_checked_at_the_first_step_after_a_load_in_either_order(tmp_path, weights_first):
    state, _ = _checkpoint(tmp_path)
    model, opt = _fresh()
    if weights_first:
        model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    if not weights_first:
        model.load_state_dict(state["model"])
    _train(opt, model, 1)  # the same weights whatever the order: the step runs
    assert opt.step_count == 4


def test_an_optimizer_state_stepped_on_other_weights_is_refused(tmp_path):
    state, _ = _checkpoint(tmp_path)
    model, opt = _fresh()  # other weights: the optimizer state was not saved with these
    opt.load_state_dict(state["opt"])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ampguard.CheckpointError, match=r"4 parameter\(s\) differ bitwise \(fc1.weight"):
        _train(opt, model, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and opt.step_count == 3
    model, opt = _fresh()  # on purpose: the state without its verdict goes on from other weights
    del state["opt"]["ampguard"]["verdict"]
    opt.load_state_dict(state["opt"])
    _train(opt, model, 1)
    assert opt.step_count == 4 and not opt.history[3].skipped


def test_a_malformed_verdict_is_refused(tmp_path):
    state, _ = _checkpoint(tmp_path)
    model, opt = _fresh()
    model.load_state_dict(state["model"])
    state["opt"]["ampguard"]["verdict"] = {"step": 3}
    with pytest.raises(ampguard.CheckpointError, match="malformed"):
        opt.load_state_dict(state["opt"])
    assert opt.step_count == 0


def test_ampguard_report_exits_3_for_a_log_that_ends_unhealthy(tmp_path, capsys):
    from ampguard.runlog.command import report_main

    for name, eps in (("healthy", 1e-8), ("poisoned", 0.0)):
        torch.manual_seed(0)
        model = _Gated()
        opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps), model=model, precision="bf16",
                            config=ampguard.GuardConfig(param_check_every=1),
                            exporters=[ampguard.JsonlExporter(str(tmp_path / name / "events-{rank}.jsonl"))])
        with contextlib.suppress(ampguard.NonFiniteError):
            _train(opt, model, 3)
        opt.close()
    assert report_main([str(tmp_path / "healthy")]) == 0
    assert report_main([str(tmp_path / "poisoned")]) == 3
    assert "ended unhealthy: step 0: nonfinite_params" in capsys.readouterr().err


def test_an_empty_tensor_has_no_max_and_is_finite():
    """An FSDP2 shard of an uneven split can be empty on a rank (tests/distributed caught it)."""
    from ampguard.integrity import amax_per_tensor

    assert amax_per_tensor([torch.zeros(0), torch.tensor([1.0, -3.0])]).tolist() == [0.0, 3.0]


@pytest.mark.parametrize("mixed", [False, True])
def test_the_cpu_max_is_bitwise_the_max_norm_it_replaces(mixed):
    """On the CPU max|x| comes from one ``aminmax`` per tensor, not ``_foreach_norm(inf)`` (10-30x
    slower there): the same float32 bits, NaN and Inf where a tensor holds one, +0.0 for zeros of
    either sign; other dtypes (complex) and empty tensors as before."""
    from ampguard.integrity import amax_per_tensor

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5, 7, generator=g), torch.zeros(4), -torch.zeros(3), torch.tensor([1.0, math.nan, -2.0]),
               torch.tensor([-math.inf, 2.0]), torch.tensor([math.nan, math.inf]), torch.tensor(-0.5),
               torch.randn(9, generator=g) * 1e30]
    if mixed:
        tensors += [torch.zeros(0), torch.randn(3, 4, generator=g).bfloat16(), torch.tensor([-math.inf, 1.0]).half(),
                    torch.randn(6, generator=g).double(), torch.randn(2, 2, generator=g, dtype=torch.complex64)]

    def reference(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(()) if not t.numel() else torch._foreach_norm([t], math.inf)[0].float()

    expected = torch.stack([reference(t) for t in tensors])
    got = amax_per_tensor(tensors)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got.view(torch.int32) & 0x7FFFFFFF, expected.view(torch.int32) & 0x7FFFFFFF)  # NaN's sign aside
    assert not got.signbit().any()
