"""The z-score spike detector and ZClip adaptive clipping (issue 17, item 4), on real training.

A genuine spike is a bad batch: its targets times 1000, so its loss and gradient norm jump by
orders of magnitude. Checked here: the config's validation; each detector flags the bad batch
and nothing in the warm-up or in a healthy run; skip against warn; ZClip's clipped parameters
against an independent float64 implementation of the paper's algorithm, on today's path and on
the fused fast path (``grad_scale = scale / clip_coef``); the statistics in ``state_dict`` and a
resume that continues bit for bit. Host-vs-tensor decisions: ``test_host_decision.py``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ampguard
from ampguard.config import GuardConfig

from ._models import assert_same, guarded_steps, loss_of, make_data, make_model, make_opt, snapshot


def spiky(n: int, at: tuple[int, ...], factor: float = 1000.0, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """``make_data(n)`` with the targets of the batches ``at`` multiplied by ``factor``."""
    data = make_data(n, seed=seed)
    for s in at:
        x, y = data[s]
        data[s] = (x, y * factor)
    return data


def run(config: dict, data, *, kind: str = "adamw", precision: str = "bf16") -> ampguard.GuardedOptimizer:
    model = make_model()
    opt = ampguard.wrap(make_opt(model, kind), model=model, precision=precision, config=config)
    guarded_steps(opt, model, data)
    return opt


# ---------------------------------------------------------------------------------- config
@pytest.mark.parametrize(("field", "value"), [
    ("spikes.grad_zscore", 0.0), ("spikes.grad_zscore", math.inf), ("spikes.grad_zscore", "4"), ("spikes.window", 1),
    ("spikes.window", 2.5), ("zclip", "yes"), ("zclip.z", -1.0), ("zclip.alpha", 1.0), ("zclip.alpha", 0.0),
    ("zclip.alpha", math.nan),
])
def test_bad_values_are_refused_by_name(field, value):
    part, _, name = field.partition(".")
    with pytest.raises(ValueError, match=rf"GuardConfig\.{field}=.*allowed"):
        GuardConfig.from_dict({part: {name: value}} if name else {part: value})


def test_exclusive_settings_say_which():
    with pytest.raises(ValueError, match=r"grad_factor=3.0 and grad_zscore=4.0 both set.*allowed"):
        GuardConfig(spikes=ampguard.Spikes(grad_zscore=4.0, grad_factor=3.0))
    with pytest.raises(ValueError, match=r"zclip=ZClip\(.*\) with clip_grad_norm=1.0.*allowed"):
        GuardConfig.from_dict({"zclip": {}, "clip_grad_norm": 1.0})
    cfg = GuardConfig.from_dict({"spikes": {"grad_zscore": 3, "window": 10}, "zclip": {}})
    assert (cfg.spikes.grad_zscore, cfg.spikes.window, cfg.zclip) == (3, 10, ampguard.ZClip())
    assert GuardConfig().spikes.grad_zscore is None and GuardConfig().zclip is None


def test_the_default_reports_no_threshold():
    opt = run({}, make_data(3))
    assert all(r.spike_threshold is None and r.clip_threshold is None for r in opt.history)
    opt = run({"spikes": {"grad_factor": 5.0}}, make_data(3))  # the factor detector's threshold is reported too
    assert all(r.spike_threshold is not None for r in opt.history)


# ---------------------------------------------------------------------------------- z-score detector
def test_zscore_waits_for_the_warmup():
    # step 5's bad batch falls in the warm-up (20 healthy steps): not flagged, and it enters the
    # statistics (it inflates the variance for about a window: see docs/detectors.md)
    opt = run({"spikes": {"grad_zscore": 4.0, "warmup": 20, "action": "skip"}}, spiky(30, at=(5,)))
    assert not [r.step for r in opt.history if r.grad_spike or r.skipped]
    assert opt.history[5].grad_norm > 100 * opt.history[4].grad_norm
    assert opt._pipeline.spikes.count.item() == 30


@pytest.mark.parametrize("on_spike", ["warn", "skip"])
def test_zscore_flags_the_bad_batch(on_spike):
    # step 40's bad batch is flagged and, with "skip", skipped; it never enters the statistics
    opt = run({"spikes": {"grad_zscore": 4.0, "warmup": 20, "action": on_spike}}, spiky(60, at=(40,)))
    assert [r.step for r in opt.history if r.grad_spike] == [40]
    spike = opt.history[40]
    assert spike.grad_norm > 50 * spike.spike_threshold
    assert spike.skipped == (on_spike == "skip") and spike.reason == ("grad_spike" if on_spike == "skip" else None)
    assert not spike.loss_spike  # the loss detector is not on
    (anomaly,) = [a for a in opt.anomalies if a.kind == "grad_spike"]
    assert anomaly.step == 40 and "mean + 4 std" in anomaly.detail and "~50 healthy steps" in anomaly.detail
    count = opt._pipeline.spikes.count.item()
    assert count == 59  # every step folded in except the flagged one (warm-up steps included)


def test_zscore_flags_nothing_on_a_healthy_run():
    opt = run({"spikes": {"grad_zscore": 4.0, "warmup": 20}}, make_data(150, seed=7))
    assert not [r.step for r in opt.history if r.grad_spike]
    assert all(math.isfinite(r.spike_threshold) for r in opt.history)


def test_zscore_statistics_ignore_non_finite_steps():
    from ampguard import faults

    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16",
                        config={"spikes": {"grad_zscore": 4.0, "warmup": 3}, "zclip": {"warmup": 3}})
    with faults.inject(opt, model, faults.grad("0.weight", "nan", steps=[4]), faults.loss("inf", steps=[6])):
        guarded_steps(opt, model, make_data(10))
    spikes = opt._pipeline.spikes
    assert spikes.count.item() == 8 and spikes.clip_count.item() == 8
    assert all(math.isfinite(t.item()) for t in (spikes.z_mean, spikes.z_var, spikes.clip_mean, spikes.clip_var))


# ---------------------------------------------------------------------------------- ZClip
class ZClipReference:
    """The paper's algorithm (Kumar et al. 2025, arXiv:2504.02507; bluorion-com/ZClip, mode
    "zscore", clip_option "adaptive_scaling"), in float64 Python, written from the paper and
    independent of ampguard: a warm-up buffer of ``warmup`` norms gives the initial mean and
    population variance; then ``z = (g - mean) / (std + eps)``; above ``z_thresh`` the threshold
    is ``mean + z_thresh * std / (z / z_thresh)``; the EMA takes the threshold (clipped) or the norm.
    One departure, ampguard's: a non-finite norm is neither clipped nor recorded."""

    def __init__(self, alpha: float, z_thresh: float, warmup: int) -> None:
        self.alpha, self.z_thresh, self.warmup = alpha, z_thresh, warmup
        self.buffer: list[float] = []
        self.mean = self.var = math.nan

    def coef(self, g: float) -> float:
        if not math.isfinite(g):
            return 1.0
        if len(self.buffer) < self.warmup:
            self.buffer.append(g)
            if len(self.buffer) == self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
            return 1.0
        std = self.var ** 0.5
        z = (g - self.mean) / (std + 1e-6)
        clip = None
        if z > self.z_thresh:
            clip = self.mean + (self.z_thresh * std) / (z / self.z_thresh)
        x = g if clip is None else clip
        self.mean = self.alpha * self.mean + (1 - self.alpha) * x
        self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
        return 1.0 if clip is None else min(1.0, clip / (g + 1e-6))


# Tolerance: the guard keeps the statistics in float32 (the reference in float64) and computes the
# threshold as mean + z**2 * std / z (one division fewer), so the coefficients differ by float32
# rounding; Adam (lr 1e-2) carries that into the parameters and moments. Observed over these 40
# steps (torch 2.13 CPU, both paths, both decisions): coefficients within 8.6e-8 relative; max
# |difference| 1.5e-8 in any parameter or optimizer state element, max relative 2.4e-5 (elements
# near zero, of the moments). Hence coefficients rel 1e-6, state atol 1e-6 (67x) and rtol 1e-4.
ZCLIP_RTOL, ZCLIP_ATOL = 1e-4, 1e-6
ZCLIP_CFG = {"zclip": {"z": 2.5, "alpha": 0.97, "warmup": 10}}
ZCLIP_DATA = dict(n=40, at=(25, 33), factor=20.0)
SCALE = 2.0**8  # fp16: the bad batches' gradients do not overflow (an overflow is skipped, not clipped)


def _reference_run(data, *, fused: bool, precision: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    """The plain loop: [scale; backward; unscale_;] the total norm from clip_grad_norm_, the
    reference's coefficient, gradients times it, [scaler.]step."""
    model = make_model()
    opt = make_opt(model, "adamw_fused" if fused else "adamw")
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if precision == "fp16" else None
    ref = ZClipReference(alpha=0.97, z_thresh=2.5, warmup=10)
    coefs = []
    for x, y in data:
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_of(model, x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        coef = ref.coef(norm)
        coefs.append(coef)
        if coef < 1.0:
            for p in model.parameters():
                p.grad.mul_(coef)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, coefs


@pytest.mark.parametrize(("fused", "precision"), [(False, "bf16"), (True, "fp16")],
                         ids=["todays-path", "fused-fast-path"])
@pytest.mark.parametrize("host", [True, False], ids=["host-decision", "tensor-decision"])
def test_zclip_clips_as_the_paper_within_tolerance(fused, precision, host):
    data = spiky(**ZCLIP_DATA)
    ref_model, ref_opt, ref_coefs = _reference_run(data, fused=fused, precision=precision)
    model = make_model()
    kw = {"scaler": torch.amp.GradScaler("cpu", init_scale=SCALE)} if precision == "fp16" else {}
    opt = ampguard.wrap(make_opt(model, "adamw_fused" if fused else "adamw"), model=model, precision=precision,
                        config=ZCLIP_CFG, **kw)
    opt._pipeline.host_decision = host
    taken = []
    measure = opt._pipeline.measure
    opt._pipeline.measure = lambda guard, **kw: taken.append(m := measure(guard, **kw)) or m
    guarded_steps(opt, model, data)
    assert all(m.scaled == fused for m in taken)  # the fast path was (or was not) taken throughout
    coefs = [r.clip_coef for r in opt.history]
    clipped = [i for i, c in enumerate(ref_coefs) if c < 1.0]
    assert 25 in clipped and 33 in clipped and [i for i, c in enumerate(coefs) if c < 1.0] == clipped
    assert coefs == pytest.approx(ref_coefs, rel=1e-6)
    for i in clipped:  # the norm let through is the threshold
        r = opt.history[i]
        assert r.grad_norm * r.clip_coef == pytest.approx(r.clip_threshold, rel=1e-5)
        assert not r.grad_spike and not r.skipped  # ZClip clips; it is not a spike detector
    assert all(r.clip_threshold == math.inf for r in list(opt.history)[:10])  # warm-up
    a, b = snapshot(ref_model, ref_opt), snapshot(model, opt)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=ZCLIP_RTOL, atol=ZCLIP_ATOL, msg=k)


def test_zclip_and_the_zscore_detector_together():
    opt = run({"zclip": {**ZCLIP_CFG["zclip"], "warmup": 20}, "spikes": {"grad_zscore": 4.0, "warmup": 20,
                                                                     "action": "skip"}},
              spiky(60, at=(40,)))
    r = opt.history[40]
    assert r.grad_spike and r.skipped and r.clip_coef < 1.0  # the spike is both flagged and (moot) clipped
    assert [s.step for s in opt.history if s.skipped] == [40]


# ---------------------------------------------------------------------------------- state
def test_statistics_survive_a_resume_bit_for_bit():
    cfg = {"zclip": {**ZCLIP_CFG["zclip"], "warmup": 5}, "spikes": {"grad_zscore": 4.0, "warmup": 5}}
    data = spiky(30, at=(12, 24))
    whole_model = make_model()
    whole = ampguard.wrap(make_opt(whole_model), model=whole_model, precision="bf16", config=cfg)
    guarded_steps(whole, whole_model, data)

    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16", config=cfg)
    guarded_steps(opt, model, data[:15])
    sd = copy.deepcopy(opt.state_dict())
    g = sd["ampguard"]
    assert g["zclip_count"] == 15 and g["z_var"] > 0 and g["zclip_var"] > 0
    params = copy.deepcopy(model.state_dict())

    model2 = make_model(seed=5)
    model2.load_state_dict(params)
    opt2 = ampguard.wrap(make_opt(model2), model=model2, precision="bf16", config=cfg)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["ampguard"] == g
    guarded_steps(opt2, model2, data[15:])
    assert_same(snapshot(model2, opt2), snapshot(whole_model, whole))
    for r in list(whole.history)[15:]:
        r2 = opt2.history[r.step]
        assert (r2.grad_spike, r2.clip_coef, r2.spike_threshold, r2.clip_threshold) == (
            r.grad_spike, r.clip_coef, r.spike_threshold, r.clip_threshold)
    assert any(r.grad_spike for r in list(whole.history)[15:]) and any(r.clip_coef < 1 for r in whole.history)


def test_a_state_without_the_statistics_loads_them_fresh():
    cfg = {**ZCLIP_CFG, "spikes": {"grad_zscore": 4.0, "warmup": 10}}
    opt = run(cfg, make_data(12))
    sd = opt.state_dict()
    for key in ("z_mean", "z_var", "zclip_mean", "zclip_var", "zclip_count"):
        del sd["ampguard"][key]  # as an earlier version wrote it
    fresh = run(cfg, make_data(3))
    fresh.load_state_dict(sd)
    spikes = fresh._pipeline.spikes
    assert [t.item() for t in (spikes.z_mean, spikes.z_var, spikes.clip_mean, spikes.clip_var,
                               spikes.clip_count)] == [0.0] * 5
    assert spikes.count.item() == 12  # the factor detector's statistics still load


def test_thresholds_travel_through_the_event_log(tmp_path):
    from ampguard import runlog
    from ampguard.exporters import JsonlExporter

    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16", exporters=[JsonlExporter(tmp_path, True)],
                        config={"zclip": {**ZCLIP_CFG["zclip"], "warmup": 3},
                                "spikes": {"grad_zscore": 4.0, "warmup": 3}})
    guarded_steps(opt, model, make_data(6))
    opt.close()
    logged = runlog.load_run(tmp_path).ranks[0].reports
    assert logged == list(opt.history)  # inf (ZClip's warm-up) and floats read back as written
    assert logged[0].clip_threshold == math.inf and math.isfinite(logged[5].clip_threshold)
