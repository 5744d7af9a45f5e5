"""Issue 17, item 2: sampled fp16 underflow (zero fraction) and headroom, and the headroom scale policy.

Real causes on CPU: a tiny model under fp16 autocast (``torch.amp.GradScaler("cpu")``), whose
gradients underflow at a low loss scale. Independent values come from a pre-unscale hook, which
sees this rank's still-scaled gradients just before the guard reads them.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import ampguard
from ampguard import faults
from ampguard.config import GuardConfig
from ampguard.stats import Dec, Loc

from ._models import assert_same, guarded_steps, make_data, make_model, snapshot
from .test_host_decision import Carried, clean, rand_carried, rand_config, rand_row, run_both


def two_groups(model: torch.nn.Module, kind: str = "sgd") -> torch.optim.Optimizer:
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 5e-3}]
    if kind == "adamw_fused":
        return torch.optim.AdamW(groups, lr=1e-2, fused=True)
    return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)


def fp16_guard(model, opt, scale: float = 2.0**16, **cfg) -> ampguard.GuardedOptimizer:
    return ampguard.wrap(opt, model=model, precision="fp16",
                         scaler=torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10_000),
                         config=GuardConfig(**{"min_scale": 2.0**-30, **cfg}))


class ScaledGrads:
    """A pre-unscale hook: this rank's still-scaled gradients of every step, per param group."""

    def __init__(self, opt: ampguard.GuardedOptimizer) -> None:
        self.opt, self.steps = opt, {}
        opt.register_pre_unscale_hook(self)

    def __call__(self, step: int) -> None:
        self.steps[step] = [[p.grad.detach().clone() for p in g["params"] if p.grad is not None]
                            for g in self.opt.param_groups]

    def expected(self, step: int) -> tuple[float, tuple[float, ...], float]:
        groups = self.steps[step]
        zeros = [sum(int((g == 0).sum()) for g in grads) for grads in groups]
        sizes = [sum(g.numel() for g in grads) for grads in groups]
        peak = max(float(g.abs().max()) for grads in groups for g in grads)
        fractions = tuple(z / n if n else math.nan for z, n in zip(zeros, sizes))
        return sum(zeros) / sum(sizes), fractions, math.log2(65504.0 / peak)


def check_against(report: ampguard.StepReport, expected: tuple[float, tuple[float, ...], float]) -> None:
    total, groups, headroom = expected
    assert report.grad_zero_fraction == pytest.approx(total, abs=1e-7)
    assert report.group_zero_fractions is not None and len(report.group_zero_fractions) == len(groups)
    for got, want in zip(report.group_zero_fractions, groups):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-7)
    assert report.headroom_log2 == pytest.approx(headroom, abs=1e-5)


def test_a_low_scale_underflows_and_the_zero_fraction_rises():
    fractions = {}
    for scale in (2.0**-24, 2.0**12):
        model = make_model()
        opt = fp16_guard(model, two_groups(model), scale=scale, numerics_every=1)
        guarded_steps(opt, model, make_data(3))
        fractions[scale] = [r.grad_zero_fraction for r in opt.history]
    assert min(fractions[2.0**-24]) > 0.5  # fp16 gradients below 2**-24 * 2**-24 flush to zero
    assert max(fractions[2.0**12]) < 0.2  # only the Tanh's saturated/ReLU-free exact zeros, if any
    assert min(fractions[2.0**-24]) > max(fractions[2.0**12])


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("user_unscales", [False, True])
def test_values_equal_an_independent_count_of_the_scaled_gradients(kind, user_unscales):
    """Unscale-first path (SGD), fused fast path (grads still scaled at measure), and a user's
    ``unscale_()`` first (max|scaled| = max|unscaled| * scale): the same values as counted here."""
    model = make_model()
    opt = fp16_guard(model, two_groups(model, kind), scale=2.0**-14, numerics_every=2)
    seen = ScaledGrads(opt)
    for step, (x, y) in enumerate(make_data(5)):
        with opt.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.backward(loss)
        if user_unscales:
            opt.unscale_()
        opt.step()
        opt.zero_grad()
        report = opt.last_report
        if step % 2:
            assert report.grad_zero_fraction is None and report.group_zero_fractions is None
            assert report.headroom_log2 is None
        else:
            check_against(report, seen.expected(step))
    assert 0 < opt.history[0].grad_zero_fraction < 1  # a low scale: some, not all, underflow


def test_a_frozen_layer_is_not_counted():
    model = make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = fp16_guard(model, two_groups(model), scale=2.0**-14, numerics_every=1)
    seen = ScaledGrads(opt)
    guarded_steps(opt, model, make_data(2))
    report = opt.history[1]
    check_against(report, seen.expected(1))
    assert math.isnan(report.group_zero_fractions[0])  # the frozen group has no gradient element
    assert report.grad_zero_fraction == report.group_zero_fractions[1]


def test_bf16_reports_the_zero_fraction_and_no_headroom():
    model = make_model()
    opt = ampguard.wrap(two_groups(model), model=model, precision="bf16", config=GuardConfig(numerics_every=1))
    guarded_steps(opt, model, make_data(2))
    report = opt.last_report
    assert report.headroom_log2 is None
    assert report.grad_zero_fraction is not None and len(report.group_zero_fractions) == 2


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_measuring_changes_no_parameter(kind):
    """With the default scale policy the measurement only reads: parameters and optimizer state
    bitwise those of a run without it (through a low scale with underflow, and overflows)."""
    results = []
    for every in (None, 1, 3):
        model = make_model()
        opt = fp16_guard(model, two_groups(model, kind), scale=2.0**-22, numerics_every=every)
        opt.scaler._growth_interval = 1  # doubles every clean step: from underflow into overflows
        guarded_steps(opt, model, make_data(48))
        results.append((snapshot(model, opt.optimizer), [r.loss_scale for r in opt.history]))
        if every == 1:
            assert opt.history[0].grad_zero_fraction > 0.3 and opt.skipped_steps >= 2
    for snap, scales in results[1:]:
        assert_same(results[0][0], snap)
        assert scales == results[0][1]


# ---------------------------------------------------------------------------------------- the policy


def test_config_errors_name_the_field_and_what_to_do():
    with pytest.raises(ValueError, match=r"scale_policy='headroom' with numerics_every=None.*numerics_every=N"):
        GuardConfig(scale_policy="headroom")
    with pytest.raises(ValueError, match=r"GuardConfig.scale_policy='growth'; allowed: 'default' \| 'headroom'"):
        GuardConfig(scale_policy="growth")
    for bad in (-1, 16, 1.5, True, None):
        with pytest.raises(ValueError, match=r"GuardConfig.headroom_margin_log2=.*allowed: an int in \[0, 15\]"):
            GuardConfig(headroom_margin_log2=bad)
    model = make_model()
    inner = two_groups(model)
    before = [p.detach().clone() for p in model.parameters()]
    for precision in ("bf16", "fp32"):
        with pytest.raises(ValueError, match=rf"scale_policy='headroom' with precision='{precision}'.*"
                                             "precision='fp16'.*scale_policy='default'"):
            ampguard.wrap(inner, model=model, precision=precision,
                          config=GuardConfig(numerics_every=5, scale_policy="headroom"))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not hasattr(inner, "found_inf")


def test_the_headroom_policy_sets_the_scale_from_the_measured_headroom():
    model = make_model()
    opt = fp16_guard(model, two_groups(model), scale=2.0**-14, numerics_every=3, scale_policy="headroom",
                     headroom_margin_log2=3)
    opt.scaler._growth_interval = 1  # GradScaler's timer would grow the scale every step: it must not
    seen = ScaledGrads(opt)
    guarded_steps(opt, model, make_data(10))
    for r in opt.history:
        if r.step % 3 or r.skipped:
            assert r.next_loss_scale == r.loss_scale or r.scale_backoff  # held between samples
            continue
        peak = max(float(g.abs().max()) for grads in seen.steps[r.step] for g in grads)
        want = min(max(r.loss_scale * 2.0 ** (math.floor(math.log2(65504.0 / peak)) - 3), 2.0**-30), 2.0**24)
        assert r.next_loss_scale == want
        assert r.scale_growth == (want > r.loss_scale)
        # the largest scaled gradient is aimed at 65504 / 2**3 .. 65504 / 2**4 (barring the clamp)
        assert 65504.0 / 2**4 < peak * want / r.loss_scale <= 65504.0 / 2**3
    assert opt.history[0].next_loss_scale > 2.0**-14  # it grew from the low start, in one step
    assert opt.scaler._growth_tracker.item() == 0


def test_the_headroom_policy_still_skips_and_backs_off_on_overflow():
    model = make_model()
    opt = fp16_guard(model, two_groups(model), scale=2.0**24, numerics_every=1, scale_policy="headroom")
    guarded_steps(opt, model, make_data(16))
    first = opt.history[0]
    assert first.skipped and first.scale_backoff and first.next_loss_scale == 2.0**23
    assert not first.headroom_log2 >= 0  # -inf (an inf gradient) or NaN (a NaN one): none left
    taken = [r for r in opt.history if not r.skipped]
    assert taken and all(r.headroom_log2 >= 0 for r in taken)
    assert taken[-1].next_loss_scale * 65504 / 2**taken[-1].headroom_log2 <= 65504 / 4 * taken[-1].loss_scale


def test_the_headroom_policy_state_survives_a_checkpoint():
    def build():
        model = make_model()
        return model, fp16_guard(model, two_groups(model), scale=2.0**-6, numerics_every=2,
                                 scale_policy="headroom")

    model, opt = build()
    data = make_data(12)
    guarded_steps(opt, model, data)
    whole = (snapshot(model, opt.optimizer), opt.scaler.get_scale())

    model, opt = build()
    guarded_steps(opt, model, data[:5])
    state = opt.state_dict()
    assert state["ampguard"]["scale_policy"] == "headroom"
    model2, opt2 = build()
    model2.load_state_dict(model.state_dict())
    bad = {**state, "ampguard": {**state["ampguard"], "scale_policy": "grow"}}
    scale_before = opt2.scaler.get_scale()
    with pytest.raises(ValueError, match=r"\['scale_policy'\] is 'grow'; expected 'default' \| 'headroom'"):
        opt2.load_state_dict(bad)
    assert opt2.scaler.get_scale() == scale_before and opt2.step_count == 0  # a failed load changes nothing
    opt2.load_state_dict(state)
    guarded_steps(opt2, model2, data[5:])
    assert_same(whole[0], snapshot(model2, opt2.optimizer))
    assert opt2.scaler.get_scale() == whole[1]


# ---------------------------------------------------------------------------------------- host == tensor


@pytest.mark.parametrize("seed", range(4))
def test_host_and_tensor_decisions_agree_under_the_headroom_policy(seed):
    rng = random.Random(500 + seed)
    for _ in range(150):
        config = rand_config(rng).replace(numerics_every=1, scale_policy="headroom",
                                          headroom_margin_log2=rng.choice([0, 2, 5, 15]))
        world = rng.choice([1, 2, 3])
        rows = [rand_row(rng, p_bad=rng.choice([0.0, 0.2])) for _ in range(world)]
        for row in rows:
            row[Loc.HEADROOM] = rng.choice([math.nan, math.inf, -math.inf, 0.0, -0.5, 0.999, 3.7, 17.2, 40.0,
                                            150.0, -150.0, rng.uniform(-20, 40)])
        carried = rand_carried(rng)
        if carried.scale is None:
            carried.scale = 1024.0
        run_both(torch.tensor(rows, dtype=torch.float32), config, carried)


def test_the_headroom_policy_exactly():
    config = GuardConfig(numerics_every=1, scale_policy="headroom", min_scale=2.0**-10, max_scale=2.0**20)
    for h in (math.nan, 0.0, 1.9999, 2.0, 7.3, -1.2, 60.0, -60.0):
        for world in (1, 2):
            g = clean(world, headroom=h)
            if world == 2:
                g[1, Loc.HEADROOM] = h + 3  # the other rank has more room: the minimum decides
            run_both(g, config, Carried(scale=1024.0, tracker=5, growth_interval=1))
    # a skipped step for another reason holds; an overflow backs off
    run_both(clean(headroom=8.0, loss=math.nan, loss_nonfinite=1.0), config, Carried(scale=1024.0))
    run_both(clean(headroom=-math.inf, found_inf=1.0), config, Carried(scale=1024.0))


def test_the_decision_sets_the_scale_from_the_smallest_headroom():
    from ampguard.policies import decide

    config = GuardConfig(numerics_every=1, scale_policy="headroom")
    g = clean(3, headroom=9.5)
    g[1, Loc.HEADROOM] = 4.2
    spikes, state, view = Carried(scale=1024.0).tensors()
    out, tracker = decide(g, config=config, spikes=spikes, scale_state=state, scaler=view, grads_sharded=False)
    assert out[Dec.NEXT_SCALE].item() == 1024.0 * 2.0 ** (4 - 2)
    assert tracker.item() == 0


# ---------------------------------------------------------------------------------------- exporters


def exported_run(tmp_path, port: int):
    """A real fp16 run with two param groups, sampled every 2 steps, into every exporter."""
    from ampguard.exporters import JsonlExporter, PrometheusExporter, TensorBoardExporter

    model = make_model()
    prom = PrometheusExporter(port=port, addr="127.0.0.1")
    opt = ampguard.wrap(two_groups(model), model=model, precision="fp16",
                        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**-14),
                        config=GuardConfig(numerics_every=2, min_scale=2.0**-30),
                        exporters=[prom, TensorBoardExporter(tmp_path / "tb", histogram_every=None),
                                   JsonlExporter(tmp_path / "events.jsonl", every_step=True)])
    return model, opt, prom


def test_every_exporter_carries_the_sampled_series(tmp_path):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ampguard import metrics as M
    from ampguard.runlog import load_run, report_main

    from .test_exporters import _free_port

    model, opt, prom = exported_run(tmp_path, _free_port())
    try:
        def scrape() -> dict:
            with urllib.request.urlopen(prom.url, timeout=5) as r:
                text = r.read().decode()
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples}

        before = scrape()  # every group label exists at open, NaN until a sampled step
        lab = (("local_rank", "0"), ("rank", "0"))
        for group in ("all", "0", "1"):
            assert math.isnan(before[(M.GRAD_ZERO_FRACTION.name, (("group", group), *lab))])
        assert math.isnan(before[(M.LOSS_SCALE_HEADROOM.name, lab)])
        guarded_steps(opt, model, make_data(5))
        opt.flush()  # healthy steps' reports are exported in batches: flush() hands them over now
        after = scrape()
        last = opt.history[4]  # the last sampled step
        assert after[(M.GRAD_ZERO_FRACTION.name, (("group", "all"), *lab))] == last.grad_zero_fraction
        for g, value in enumerate(last.group_zero_fractions):
            assert after[(M.GRAD_ZERO_FRACTION.name, (("group", str(g)), *lab))] == value
        assert after[(M.LOSS_SCALE_HEADROOM.name, lab)] == last.headroom_log2
    finally:
        opt.close()

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    sampled = [r for r in opt.history if r.grad_zero_fraction is not None]
    assert [r.step for r in sampled] == [0, 2, 4]
    for tag, field in (("ampguard/grad_zero_fraction", "grad_zero_fraction"),
                       ("ampguard/loss_scale_headroom_log2", "headroom_log2")):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert got == [(r.step, pytest.approx(getattr(r, field))) for r in sampled], tag
    assert [e.step for e in acc.Scalars("ampguard/grad_zero_fraction/group1")] == [0, 2, 4]

    run = load_run(tmp_path / "events.jsonl")
    (log,) = run.ranks.values()
    assert [(r.step, r.grad_zero_fraction, r.group_zero_fractions, r.headroom_log2) for r in log.reports] == [
        (r.step, r.grad_zero_fraction, r.group_zero_fractions, r.headroom_log2) for r in opt.history]
    png = tmp_path / "report.png"
    assert report_main([str(tmp_path / "events.jsonl"), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_the_log_reads_back_none_nan_and_inf(tmp_path):
    """A report whose numerics are NaN / -inf (an overflow) and a group without gradients: the
    JSONL strings "nan"/"-inf" and null read back as the report held them."""
    from ampguard.exporters import JsonlExporter
    from ampguard.runlog import load_run

    from .test_exporters import _info, _report

    log = JsonlExporter(tmp_path / "e.jsonl", every_step=True)
    log.open(_info())
    reports = [_report(0, grad_zero_fraction=0.25, group_zero_fractions=(math.nan, 0.5), headroom_log2=-math.inf),
               _report(1), _report(2, grad_zero_fraction=0.0, group_zero_fractions=(0.0,), headroom_log2=None)]
    for r in reports:
        log.export(r, [])
    log.close()
    (read,) = load_run(tmp_path / "e.jsonl").ranks.values()
    got = read.reports
    assert got[0].grad_zero_fraction == 0.25 and got[0].headroom_log2 == -math.inf
    assert math.isnan(got[0].group_zero_fractions[0]) and got[0].group_zero_fractions[1] == 0.5
    assert got[1].grad_zero_fraction is None and got[1].group_zero_fractions is None and got[1].headroom_log2 is None
    assert got[2].group_zero_fractions == (0.0,) and got[2].headroom_log2 is None


# ---------------------------------------------------------------------------------------- the benchmark


def test_the_benchmark_smoke_run_writes_json_and_markdown(tmp_path):
    """``benchmarks/numerics.py --device cpu --quick``: both phases run and write their tables (the
    numbers of a smoke run mean nothing; the GPU run is the lead's)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "numerics_smoke"
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "numerics.py"), "--device", "cpu", "--quick",
                          "--blocks", "1", "--steps", "6", "--out", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["cost"]["ratio"]) == {"p25", "median", "p75"} and data["cost"]["numerics_every"] == 10
    runs = data["policy"]["runs"]
    assert set(runs) == {"default", "headroom"} and runs["default"]["steps"] == 6
    for run in runs.values():
        assert {"skipped", "zero_fraction_mean", "final_loss", "loss_curve", "loss_scale"} <= set(run)
    table = out.with_suffix(".md").read_text()
    assert "| default |" in table and "| headroom |" in table and "**Verdict:**" in table


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_a_guarded_run_under_the_headroom_policy_is_the_same_on_both_paths(kind):
    """End to end on CPU: the host decision and the tensor decision give the same run (parameters,
    reports, scale), through underflow at the start, headroom moves and overflows."""
    from .test_host_decision import both_paths

    def make(m):
        return fp16_guard(m, two_groups(m, kind), scale=2.0**-20, numerics_every=3, scale_policy="headroom",
                          headroom_margin_log2=0)

    hist = both_paths(make, 18, faults.grad("0.weight", "inf", steps=[7]))
    assert any(r.scale_growth for r in hist) and any(r.skipped for r in hist)


def test_the_headroom_rides_the_local_vector_on_both_paths():
    from ampguard.stats import local_vector

    from .test_host_decision import bits

    for h in (None, 3.25, -math.inf, math.inf, math.nan, 1e-3):
        kw = dict(loss=torch.tensor(1.5), tensor_norms=torch.tensor([1.0, 2.0]), found_inf=None, pre_reduction=None,
                  device=torch.device("cpu"), headroom=None if h is None else torch.tensor(h))
        a, b = local_vector(**kw, host=False).tolist(), local_vector(**kw, host=True).tolist()
        assert [bits(x) for x in a] == [bits(x) for x in b]
        want = math.nan if h is None else torch.tensor(h).item()  # float32
        assert bits(a[Loc.HEADROOM]) == bits(want)


def test_the_measurement_of_large_and_small_tensors_in_several_groups():
    """Counted per large tensor and once over a group's small ones: the same exact counts."""
    from ampguard.numerics import Numerics
    from ampguard.stats import grads_by_device_and_dtype

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (70_000, 5, 300, 1 << 16, 7)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * (torch.rand(p.shape, generator=g) > 0.3)
    params[3].grad = None  # a parameter without gradient (frozen, unused)
    param_groups = [{"params": params[:2]}, {"params": params[2:4]}, {"params": params[4:]}]
    got = Numerics(1, device=torch.device("cpu"), headroom=True).measure(
        grads_by_device_and_dtype(params), param_groups, torch.tensor([8.0])).tolist()
    zeros = [[int((p.grad == 0).sum()) for p in grp["params"] if p.grad is not None] for grp in param_groups]
    sizes = [[p.grad.numel() for p in grp["params"] if p.grad is not None] for grp in param_groups]
    assert got[0] == pytest.approx(sum(map(sum, zeros)) / sum(map(sum, sizes)), rel=1e-6)
    assert got[2:] == pytest.approx([sum(z) / sum(n) for z, n in zip(zeros, sizes)], rel=1e-6)
    peak = max(float(p.grad.abs().max()) for p in params if p.grad is not None) * 8.0
    assert got[1] == pytest.approx(math.log2(65504.0 / peak), abs=1e-5)


def test_the_cpu_peak_is_bitwise_the_max_norm_it_replaces():
    """On the CPU the sampled headroom's max|g| per group comes from one ``aminmax`` per gradient
    (:func:`ampguard.stats.cpu_amax`), not ``_foreach_norm(inf)``: the same float32 value, NaN and
    Inf included; an empty gradient still goes to the norm (which refuses it, as before)."""
    from ampguard.numerics import _peak

    g = torch.Generator().manual_seed(5)
    groups = [[torch.randn(3, 4, generator=g), torch.randn(7, generator=g)], [torch.tensor([1.0, math.nan])],
              [torch.tensor([-math.inf, 1.0]), torch.ones(2)], [torch.zeros(3), -torch.zeros(2)],
              [torch.randn(4, generator=g).bfloat16(), torch.tensor([-7.0, 2.0]).bfloat16()],
              [torch.randn(100, generator=g).half()]]
    for grads in groups:
        expected = torch.stack(torch._foreach_norm(grads, math.inf)).float().amax()
        got = _peak(grads)
        assert got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32) & 0x7FFFFFFF, expected.view(torch.int32) & 0x7FFFFFFF)
    with pytest.raises(RuntimeError):
        _peak([torch.zeros(0), torch.ones(2)])
