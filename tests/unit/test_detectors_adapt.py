"""Detectors that adapt: no statistic locks itself out (docs/detectors.md, "After a lasting shift").

The failing input is real training whose data shifts for good: from step 50 on the targets are
ten times larger (a new data mix, the end of a warm-up), so the loss and the gradient norm move to
a new level and stay there. Before the fix a skipping detector learnt only from the steps it took,
so the new level was a "spike" for ever: 0-6 of the later steps were taken, and ZClip clipped
every later step. Now each detector re-bases its statistics after ``warmup`` flagged steps
in a row (a ``rebaseline`` anomaly) and takes steps again; a single bad batch, and a burst shorter
than the bound, are still skipped. Host-vs-tensor equality of the rule: test_host_decision.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ampguard
from ampguard.vocab import AnomalyKind

from ._models import assert_same, guarded_steps, make_data, make_model, make_opt, snapshot

K = 8  # Spikes.warmup / ZClip.warmup: the warm-up, and the bound on flagged steps in a row
SHIFT = 50
STEPS = 80
BAD = (25,)  # one bad batch (targets x10 for one step)
BURST = (33, 34, 35)  # a burst of bad batches shorter than the bound


def shifted(n: int = STEPS, *, at: int = SHIFT, bad: tuple[int, ...] = BAD + BURST,
            factor: float = 10.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``make_data(n)`` with targets x``factor`` from step ``at`` on, and on the bad batches."""
    return [(x, y * factor) if i >= at or i in bad else (x, y) for i, (x, y) in enumerate(make_data(n))]


DETECTORS = {
    "factor": {"spikes": {"grad_factor": 3.0}},
    "zscore": {"spikes": {"grad_zscore": 4.0}},
    "loss": {"spikes": {"loss_factor": 10.0}},
}


def train(config: dict, data, model: torch.nn.Module | None = None) -> ampguard.GuardedOptimizer:
    model = make_model() if model is None else model
    config = {**config, **{part: {"warmup": K, **config[part]} for part in ("spikes", "zclip") if part in config}}
    opt = ampguard.wrap(make_opt(model), model=model, precision="bf16", config=config)
    guarded_steps(opt, model, data)
    return opt


def rebaselines(opt: ampguard.GuardedOptimizer) -> list[int]:
    return [a.step for a in opt.anomalies if a.kind == AnomalyKind.REBASELINE]


@pytest.mark.parametrize("name", list(DETECTORS))
def test_a_skipping_detector_resumes_within_the_bound_after_a_lasting_shift(name):
    opt = train({"spikes": {**DETECTORS[name]["spikes"], "action": "skip"}}, shifted())
    h = {r.step: r for r in opt.history}
    # the bad batch and the short burst are skipped, and re-base nothing
    assert all(h[s].skipped for s in BAD + BURST)
    assert not [s for s in rebaselines(opt) if s < SHIFT]
    # the shift: K steps flagged in a row (skipped), the K-th re-bases the statistics...
    assert all(h[s].skipped for s in range(SHIFT, SHIFT + K))
    assert rebaselines(opt)[0] == SHIFT + K - 1
    assert "spike detectors flagged 8 steps in a row" in next(
        a.detail for a in opt.anomalies if a.kind == AnomalyKind.REBASELINE)
    # ...and training resumes at once: the step after the bound is taken, and nearly all later ones
    # (an odd flag later is the detector's ordinary false positive: a single step, then taken again)
    assert not h[SHIFT + K].skipped
    later = [s for s in range(SHIFT + K, STEPS) if h[s].skipped]
    assert len(later) <= 2 and all(not h[s + 1].skipped for s in later), later


@pytest.mark.parametrize("name", ["factor", "zscore"])
def test_a_warning_detector_stops_flagging_after_the_bound(name):
    opt = train({"spikes": {**DETECTORS[name]["spikes"], "action": "warn"}}, shifted(bad=()))
    flagged = [r.step for r in opt.history if r.grad_spike and r.step >= SHIFT]
    assert flagged[:K] == list(range(SHIFT, SHIFT + K)) and rebaselines(opt) == [SHIFT + K - 1]
    assert len(flagged) <= K + 2  # not the whole rest of the run (before the fix: all 50)
    assert not any(r.skipped for r in opt.history)


def test_zclip_stops_clipping_after_the_bound():
    opt = train({"zclip": {}}, shifted(bad=BAD))
    h = {r.step: r for r in opt.history}
    assert h[BAD[0]].clip_coef < 0.2  # the bad batch is clipped hard
    assert rebaselines(opt)[0] == SHIFT + K - 1 and not [s for s in rebaselines(opt) if s < SHIFT]
    assert all(h[s].clip_coef < 1 for s in range(SHIFT, SHIFT + K))
    clipped_later = [s for s in range(SHIFT + K, STEPS) if h[s].clip_coef < 1]
    assert len(clipped_later) <= 0.2 * (STEPS - SHIFT - K), clipped_later  # ordinary upper-tail clips only


def test_a_resume_inside_a_flagged_run_continues_bit_for_bit():
    cfg = {"spikes": {"grad_zscore": 4.0, "loss_factor": 10.0, "action": "skip"}, "zclip": {}}
    data = shifted(70)
    whole_model = make_model()
    whole = train(cfg, data, whole_model)
    cut = SHIFT + K // 2  # inside the run of flagged steps: the run and its statistics are state
    model = make_model()
    opt = train(cfg, data[:cut], model)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["ampguard"]["flag_run"] == K // 2 and sd["ampguard"]["zclip_run"] == K // 2
    model2 = make_model(seed=5)
    model2.load_state_dict(model.state_dict())
    opt2 = train(cfg, [], model2)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["ampguard"] == sd["ampguard"]
    guarded_steps(opt2, model2, data[cut:])
    assert_same(snapshot(model2, opt2), snapshot(whole_model, whole))
    assert rebaselines(opt2) == [s for s in rebaselines(whole) if s >= cut] and rebaselines(opt2)
    assert [(r.skipped, r.clip_coef) for r in list(opt2.history)] == [
        (r.skipped, r.clip_coef) for r in list(whole.history)[cut:]]


@pytest.mark.parametrize("key", ["flag_run", "flag_norm_var", "zclip_flag_mean"])
def test_bad_run_state_is_refused_and_a_state_without_it_loads_fresh(key):
    cfg = {"spikes": {"grad_zscore": 4.0, "action": "skip"}, "zclip": {}}
    opt = train(cfg, shifted(SHIFT + 3, bad=()))
    sd = opt.state_dict()
    assert sd["ampguard"]["flag_run"] == 3
    bad = copy.deepcopy(sd)
    bad["ampguard"][key] = -1 if key == "flag_run" else (-1.0 if key.endswith("var") else float("nan"))
    fresh = train(cfg, make_data(2))
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(ValueError, match=rf"\['{key}'\].*Nothing was loaded"):
        fresh.load_state_dict(bad)
    assert fresh.state_dict()["ampguard"] == before["ampguard"]
    old = copy.deepcopy(sd)
    for k in ("flag_run", "flag_norm_mean", "flag_norm_var", "flag_loss_mean", "zclip_run", "zclip_flag_mean",
              "zclip_flag_var"):
        del old["ampguard"][k]  # as the version before these statistics wrote it
    fresh.load_state_dict(old)
    spikes = fresh._pipeline.spikes
    assert spikes.flag_run.item() == spikes.clip_run.item() == 0 and spikes.z_var.item() == sd["ampguard"]["z_var"]
