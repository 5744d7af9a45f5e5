"""Leading indicators (issue 17, item 3): per top-level module, the gradient norm and the update
ratio ||delta w|| / ||w||, sampled every ``GuardConfig.numerics_every`` steps on the device.

Against an independent computation (``torch.linalg.vector_norm`` over the module's gradients as
the backward left them, divided by the loss scale; the weights before and after the step) on the
fused fast path, the unscale-first path, with clipping (pre-clip norms), after the user's own
``unscale_()``, and on the CPU host-decision path with a foreach optimizer; on real causes: an
exploding learning rate in one module's param group, a frozen module, natural fp16 overflows."""

from __future__ import annotations

import math
import os
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import ampguard
from ampguard.indicators import ROOT, top_level_owners

from ._models import assert_same, snapshot


class Net(torch.nn.Module):
    """Three top-level modules with parameters, one without, and a parameter of the root's own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.act = torch.nn.Tanh()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 1)
        self.gain = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.act(self.embed(x)))) * self.gain


MODULES = ("embed", "body", "head", ROOT)


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _data(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _members(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    return {"embed": list(model.embed.parameters()), "body": list(model.body.parameters()),
            "head": list(model.head.parameters()), ROOT: [model.gain]}


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().float().flatten() for t in ts]) if ts else torch.zeros(0)


# ---------------------------------------------------------------------------------- the values
PATHS = {
    # name: (precision, fused optimizer, config, the user unscales and clips)
    "fast_path": ("fp16", True, {}, False),
    "fast_path_clip": ("fp16", True, {"clip_grad_norm": 0.05}, False),
    "unscale_first": ("fp16", True, {"AMPGUARD_FUSED_FAST_PATH": "0"}, False),
    "unscale_first_clip": ("fp16", False, {"clip_grad_norm": 0.05}, False),
    "user_unscale_and_clip": ("fp16", True, {}, True),
    "host_decision_foreach_bf16": ("bf16", False, {}, False),
}


def _switches(extra: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """The AMPGUARD_* implementation switches (environment variables) apart from the config fields."""
    return ({k: v for k, v in extra.items() if k.startswith("AMPGUARD_")},
            {k: v for k, v in extra.items() if not k.startswith("AMPGUARD_")})


@pytest.mark.parametrize("path", list(PATHS))
def test_module_values_equal_an_independent_computation(path):
    precision, fused, extra, user_clip = PATHS[path]
    model = _net()
    env, extra = _switches(extra)
    with mock.patch.dict(os.environ, env):
        opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused), model=model,
                            precision=precision, config={"numerics_every": 2, "indicators_every": 2, **extra})
    assert opt.run_info.modules == MODULES
    members = _members(model)
    for step, (x, y) in enumerate(_data(6)):
        with opt.autocast():
            loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss)
        scale = opt.get_scale()
        grads = {m: [p.grad.float() / scale for p in ps] for m, ps in members.items()}  # as backward left them
        before = {m: [p.detach().clone() for p in ps] for m, ps in members.items()}
        if user_clip:
            opt.unscale_()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        report = opt.last_report
        opt.zero_grad()
        if step % 2:
            assert report.module_grad_norms is None and report.module_update_ratios is None
            continue
        assert not report.skipped
        if "clip" in path:
            assert report.clip_coef < 1 or user_clip  # the clip did act: the norms are the pre-clip ones
        norms, ratios = dict(report.module_grad_norms), dict(report.module_update_ratios)
        assert tuple(norms) == tuple(ratios) == MODULES
        for m, ps in members.items():
            want_norm = torch.linalg.vector_norm(_cat(grads[m])).item()
            dw = torch.linalg.vector_norm(_cat([p - b for p, b in zip(ps, before[m])])).item()
            want_ratio = dw / torch.linalg.vector_norm(_cat(before[m])).item()
            assert norms[m] == pytest.approx(want_norm, rel=1e-5), (m, step)
            assert ratios[m] == pytest.approx(want_ratio, rel=1e-4), (m, step)
            assert ratios[m] > 0
        total = math.sqrt(sum(v * v for v in norms.values()))
        assert total == pytest.approx(report.grad_norm, rel=1e-5)
    opt.close()


def test_a_frozen_module_has_no_norm_and_ratio_zero():
    model = _net()
    model.embed.requires_grad_(False)
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model,
                        precision="fp16", config={"numerics_every": 1, "indicators_every": 1})
    embed = [p.detach().clone() for p in model.embed.parameters()]
    for x, y in _data(3):
        with opt.autocast():
            loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        r = opt.last_report
        norms, ratios = dict(r.module_grad_norms), dict(r.module_update_ratios)
        assert norms["embed"] == 0.0 and ratios["embed"] == 0.0
        assert all(norms[m] > 0 and ratios[m] > 0 for m in ("body", "head"))
        assert math.sqrt(sum(v * v for v in norms.values())) == pytest.approx(r.grad_norm, rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(embed, model.embed.parameters()))


def test_exploding_lr_in_one_module_shows_in_its_update_ratio_before_the_first_nonfinite_step():
    """One top-level module (``2``) gets its own param group whose LR grows 20 % a step (a real
    cause, nothing injected). Its update ratio climbs past 20x its first value while the loss and
    the other modules' ratios are still flat, at least 10 steps before the first non-finite step
    (an fp16 gradient overflow: skipped, and there every ratio is exactly 0, since nothing moved).
    Its gradient norm rises too before that step (and more so downstream: the head sees the
    blown-up activations)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                torch.nn.Linear(32, 1))
    groups = [{"params": [*model[0].parameters(), *model[3].parameters()], "lr": 1e-3},
              {"params": list(model[2].parameters()), "lr": 1e-3}]
    opt = ampguard.wrap(torch.optim.AdamW(groups, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=256.0),
                        config={"numerics_every": 2, "indicators_every": 2})
    assert opt.run_info.modules == ("0", "2", "3")
    first_bad = None
    for x, y in _data(120, seed=1):
        with opt.autocast():
            loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        opt.param_groups[1]["lr"] *= 1.2
        if opt.last_report.nonfinite:
            first_bad = opt.last_report.step
            break
    assert first_bad is not None
    sampled = [r for r in opt.history if r.module_update_ratios is not None]
    ratio = [dict(r.module_update_ratios) for r in sampled]
    norm = [dict(r.module_grad_norms) for r in sampled]
    k = next(i for i, r in enumerate(ratio) if r["2"] > 20 * ratio[0]["2"])  # the indicator fires
    assert sampled[k].step <= first_bad - 10
    for m in ("0", "3"):
        flat = [r[m] for r in ratio[: k + 1]]
        assert max(flat) <= 1.5 * flat[0], (m, flat)  # no rise (Adam's first step is its largest)
    losses = [r.loss for r in opt.history if r.step <= sampled[k].step]
    assert max(losses) < 2 * losses[0]  # the loss has not moved yet
    assert max(n["2"] for n in norm[:-1]) > 3 * norm[0]["2"]
    assert sampled[-1].step == first_bad and sampled[-1].skipped  # sampled, as it happens
    for r, rs in zip(sampled, ratio):
        assert all(v == 0.0 for v in rs.values()) if r.skipped else all(v > 0.0 for v in rs.values())


# ---------------------------------------------------------------------------------- the run is unchanged
RUNS = {
    "fast_path_fp16": ("fp16", "adamw_fused", {}),
    "unscale_first_clip_fp16": ("fp16", "adamw_fused", {"AMPGUARD_FUSED_FAST_PATH": "0", "clip_grad_norm": 0.1}),
    "sgd_bf16": ("bf16", "sgd", {}),
}


def _run(kind: str, numerics_every: int | None) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    precision, opt_kind, extra = RUNS[kind]
    model = _net()
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if opt_kind == "adamw_fused"
             else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3) if precision == "fp16" else None
    env, extra = _switches(extra)
    with mock.patch.dict(os.environ, env):
        opt = ampguard.wrap(inner, model=model, precision=precision, scaler=scaler,
                            config={"numerics_every": numerics_every, "indicators_every": numerics_every, **extra})
    for x, y in _data(12):
        with opt.autocast():
            loss = F.mse_loss(model(x).float(), y) * 1e3  # large: fp16 overflows at the grown scales
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    sampled = {"wall_time", "grad_zero_fraction", "group_zero_fractions", "headroom_log2"}  # numerics: sampled too
    reports = [{k: v for k, v in r.to_dict().items() if not k.startswith("module_") and k not in sampled}
               for r in opt.history]
    opt.close()
    return snapshot(model, inner), reports


@pytest.mark.parametrize("kind", list(RUNS))
def test_parameters_are_bitwise_those_of_a_run_without_indicators(kind):
    params, reports = _run(kind, None)
    params_on, reports_on = _run(kind, 3)
    assert_same(params, params_on)
    assert reports == reports_on
    if kind.endswith("fp16"):
        assert any(r["skipped"] for r in reports)  # natural overflows were in the comparison


# ---------------------------------------------------------------------------------- names and inputs
def test_names_are_the_users_without_ddp_or_compile_wrappers():
    model = _net()
    params = list(model.parameters())
    assert top_level_owners(model, params) == (MODULES, [3, 0, 0, 1, 1, 2, 2])  # the root's own come first
    assert top_level_owners(torch.compile(model), params)[0] == MODULES
    model.body = torch.compile(model.body)  # a compiled child keeps its name
    assert top_level_owners(model, params)[0] == MODULES
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert top_level_owners(torch.compile(DDP(model)), params)[0] == MODULES
    finally:
        dist.destroy_process_group()
    plain = _net()  # no root parameter, one shared (tied) weight: its first owner takes it
    del plain.gain
    plain.forward = lambda x: x  # type: ignore[method-assign]
    plain.tied = torch.nn.Linear(16, 16)
    plain.tied.weight = plain.body[0].weight
    names, owners = top_level_owners(plain, list(plain.parameters()))
    assert names == ("embed", "body", "head", "tied") and owners == [0, 0, 1, 1, 2, 2, 3]


def test_a_model_that_does_not_hold_the_optimizers_parameters_is_refused():
    model, other = _net(), _net(1)
    with pytest.raises(ValueError, match=r"indicators_every: none of the optimizer's parameters belongs to wrap"):
        ampguard.wrap(torch.optim.SGD(other.parameters(), lr=0.1), model=model, config={"indicators_every": 5})
    with pytest.raises(ValueError, match=r"numerics_every=0"):
        ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model=model, config={"numerics_every": 0})
    # no model: nothing to attribute to; the module fields stay None
    opt = ampguard.wrap(torch.optim.SGD(model.parameters(), lr=0.1), config={"indicators_every": 1})
    opt.backward(model(torch.randn(2, 8)).sum())
    opt.step()
    assert opt.last_report.module_grad_norms is None and opt.run_info.modules == ()


def test_a_param_group_added_later_is_attributed():
    model = _net()
    opt = ampguard.wrap(torch.optim.AdamW([*model.embed.parameters(), *model.body.parameters()], lr=1e-2),
                        model=model, precision="bf16", config={"numerics_every": 1, "indicators_every": 1})
    assert opt.run_info.modules == MODULES  # listed from the model: 0 until the optimizer trains them

    def one_step() -> dict[str, float]:
        x, y = _data(1)[0]
        opt.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        return dict(opt.last_report.module_update_ratios)

    assert one_step()["head"] == 0.0
    opt.add_param_group({"params": [*model.head.parameters(), model.gain]})
    ratios = one_step()
    assert ratios["head"] > 0 and ratios[ROOT] > 0


# ---------------------------------------------------------------------------------- the event log
def test_jsonl_reads_back_and_ampguard_report_summarises_and_plots_it(tmp_path, capsys):
    from ampguard import runlog
    from ampguard.exporters import JsonlExporter
    from ampguard.runlog.command import report_main

    model = _net()
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3),
                        config={"numerics_every": 3, "indicators_every": 3},
                        exporters=[JsonlExporter(tmp_path / "run" / "", every_step=True)])
    for x, y in _data(30):
        with opt.autocast():
            loss = F.mse_loss(model(x).float(), y) * 30  # natural fp16 overflows: skipped steps in the log
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.close()
    ours = list(opt.history)
    assert any(r.skipped and r.module_update_ratios is not None for r in ours)
    logged = runlog.load_run(tmp_path / "run").ranks[0].reports
    for field in ("module_grad_norms", "module_update_ratios"):  # as written, NaN included
        assert [r.to_dict()[field] for r in logged] == [r.to_dict()[field] for r in ours]
    assert isinstance(logged[0].module_grad_norms, tuple) and logged[1].module_grad_norms is None
    png = tmp_path / "run.png"
    assert report_main([str(tmp_path / "run"), "--plot", str(png)]) == 0
    assert "picture:" in capsys.readouterr().out
    mpimg = pytest.importorskip("matplotlib.image")
    assert mpimg.imread(png).shape[:2] == (1750, 1600)  # + 250 px the indicators panel, + 300 the numerics one
