"""The CPU host decision (``policies.decide_host``) against the tensor decision (``policies.decide``).

Both run on the same gathered matrix, config and carried state; every decision field, the new
growth tracker and the carried state (spike averages, their count, the hysteresis run, the
scaler's scale) must come out the same, bit for bit (any NaN equals any NaN: no decision reads a
NaN's payload). Random matrices with NaN/inf/huge/subnormal values in any column, and sequences
of steps that run through spikes, hysteresis runs, the floor and ceiling and growth-interval
boundaries, plus end-to-end runs of the guard with each path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import struct
import warnings

import pytest
import torch

import ampguard
from ampguard import faults
from ampguard.backends import LocalBackend
from ampguard.config import GuardConfig
from ampguard.ops import HOST, TensorOps, f32
from ampguard.pipeline import StepPipeline
from ampguard.policies import SpikeState, decide, decide_host
from ampguard.scale_rule import ScalerView, ScaleState, next_scale
from ampguard.stats import DECISION_K, LOCAL_K, Dec, Loc, local_vector, total_and_nonfinite

from ._models import assert_same, guarded_steps, loss_of, make_data, make_model, make_opt, snapshot

F32_MAX = 3.4028234663852886e38


def bits(x: float) -> bytes:
    """float32 bit pattern, every NaN folded into one."""
    return b"nan" if math.isnan(x) else struct.pack("<f", x)


@dataclasses.dataclass
class Carried:
    """The state a decision reads and writes, as plain values (made into tensors per path)."""

    grad_ema: float = 0.0
    loss_ema: float = 0.0
    count: int = 0
    overflow_run: int = 0
    scale: float | None = 65536.0  # None: no scaler
    tracker: int = 0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    z_mean: float = 0.0
    z_var: float = 0.0
    clip_mean: float = 0.0
    clip_var: float = 0.0
    clip_count: int = 0
    flag_run: int = 0
    flag_norm_mean: float = 0.0
    flag_norm_var: float = 0.0
    flag_loss_mean: float = 0.0
    clip_run: int = 0
    clip_flag_mean: float = 0.0
    clip_flag_var: float = 0.0
    last: tuple[float, ...] = ()  # the decision that produced this state (not state)

    def tensors(self) -> tuple[SpikeState, ScaleState, ScalerView | None]:
        f = functools.partial(torch.tensor, dtype=torch.float32)
        i = functools.partial(torch.tensor, dtype=torch.int32)
        spikes = SpikeState(f(self.grad_ema), f(self.loss_ema), i(self.count), f(self.z_mean), f(self.z_var),
                            f(self.clip_mean), f(self.clip_var), i(self.clip_count), i(self.flag_run),
                            f(self.flag_norm_mean), f(self.flag_norm_var), f(self.flag_loss_mean), i(self.clip_run),
                            f(self.clip_flag_mean), f(self.clip_flag_var))
        state = ScaleState(torch.tensor(self.overflow_run, dtype=torch.int32))
        view = None
        if self.scale is not None:
            view = ScalerView(torch.tensor(self.scale, dtype=torch.float32),
                              torch.tensor(self.tracker, dtype=torch.int32),
                              self.growth_factor, self.backoff_factor, self.growth_interval)
        return spikes, state, view


DETECTOR_FLOATS = ("grad_ema", "loss_ema", "z_mean", "z_var", "clip_mean", "clip_var", "flag_norm_mean",
                   "flag_norm_var", "flag_loss_mean", "clip_flag_mean", "clip_flag_var")
"""The carried float32 statistics of the detectors (SpikeState), compared bit for bit."""
DETECTOR_COUNTS = ("count", "clip_count", "flag_run", "clip_run")


def run_both(gathered: torch.Tensor, config: GuardConfig, carried: Carried, sharded: bool = False) -> Carried:
    """One decision on each path from the same inputs; asserts they agree; returns the next state."""
    t_spikes, t_state, t_view = carried.tensors()
    h_spikes, h_state, h_view = carried.tensors()
    t_out, t_tracker = decide(gathered.clone(), config=config, spikes=t_spikes, scale_state=t_state, scaler=t_view,
                              grads_sharded=sharded)
    h_out, h_tracker = decide_host(gathered.clone(), config=config, spikes=h_spikes, scale_state=h_state,
                                   scaler=h_view, grads_sharded=sharded)
    t_vals = t_out.tolist()
    assert len(h_out) == DECISION_K
    for name, field in ((k, v) for k, v in vars(Dec).items() if k.isupper()):
        assert bits(h_out[field]) == bits(t_vals[field]), (
            f"{name}: host {h_out[field]!r} != tensor {t_vals[field]!r}\n{gathered}\n{config}\n{carried}")
        assert h_out[field] == f32(h_out[field]) or math.isnan(h_out[field])  # a float32 value
    if t_tracker is None:
        assert h_tracker is None
    else:
        assert h_tracker == int(t_tracker.item())
    for name in DETECTOR_FLOATS:
        a, b = getattr(t_spikes, name).item(), getattr(h_spikes, name).item()
        assert bits(a) == bits(b), f"{name}: host {b!r} != tensor {a!r}\n{gathered}\n{config}\n{carried}"
    for name in DETECTOR_COUNTS:
        assert getattr(t_spikes, name).item() == getattr(h_spikes, name).item(), name
    assert t_state.overflow_run.item() == h_state.overflow_run.item()
    # the host path only reads the scaler: the pipeline writes the new scale and tracker
    if t_view is not None and h_view is not None:
        assert bits(t_view.scale.item()) == bits(h_view.scale.item())
    return dataclasses.replace(
        carried, **{n: getattr(h_spikes, n).item() for n in DETECTOR_FLOATS},
        **{n: int(getattr(h_spikes, n).item()) for n in DETECTOR_COUNTS},
        overflow_run=int(h_state.overflow_run.item()),
        scale=None if carried.scale is None else h_out[Dec.NEXT_SCALE],
        tracker=carried.tracker if h_tracker is None else h_tracker, last=tuple(h_out),
    )


# ---------------------------------------------------------------------------------------- inputs

SPECIAL = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 1e-40, F32_MAX, 3e38, 1e30, 1e-30]


def rand_value(rng: random.Random, *, nonneg: bool = False) -> float:
    r = rng.random()
    if r < 0.12:
        v = rng.choice(SPECIAL)
    elif r < 0.55:
        v = math.exp(rng.uniform(-12, 12))
    else:
        v = rng.uniform(0, 10)
    if not nonneg and rng.random() < 0.1:
        v = -v
    return v


def rand_row(rng: random.Random, p_bad: float) -> list[float]:
    row = [0.0] * LOCAL_K
    row[Loc.LOSS] = rand_value(rng) if rng.random() < p_bad else rng.uniform(0, 5)
    row[Loc.LOSS_NONFINITE] = 0.0 if math.isfinite(row[Loc.LOSS]) else 1.0
    row[Loc.GRAD_NORM] = rand_value(rng, nonneg=True) if rng.random() < p_bad else rng.uniform(0, 20)
    row[Loc.NONFINITE_TENSORS] = float(rng.choice([0, 0, 0, 1, 3])) if rng.random() < p_bad else 0.0
    row[Loc.FOUND_INF] = float(rng.random() < p_bad / 2)
    row[Loc.PRE_REDUCTION] = float(rng.random() < p_bad / 4)
    row[Loc.NO_GRADS] = float(rng.random() < p_bad / 4)
    row[Loc.HEADROOM] = rng.choice([math.nan, math.nan, rng.uniform(-3, 40), rng.uniform(-300, 300)])
    if rng.random() < p_bad / 3:  # anything in any column, inconsistent flags included
        row[rng.randrange(LOCAL_K)] = rng.choice([*SPECIAL, rand_value(rng)])
    return row


def rand_config(rng: random.Random) -> GuardConfig:
    min_scale = rng.choice([1.0, 0.1, 1 / 3, 2.0**-20, 7.0])
    detector = rng.choice(["factor", "factor", "zscore"])
    zclip = rng.random() < 0.3
    zscore = rng.choice([4.0, 3.0, 0.7, 2.123456789])
    warmup = rng.choice([1, 2, 3, 20])
    return GuardConfig(
        spikes=ampguard.Spikes(
            grad_zscore=zscore if detector == "zscore" else None,
            window=rng.choice([2, 5, 50, 333]),
            grad_factor=None if detector == "zscore" else rng.choice([None, 2.0, 3.3, 1.0000001, 10.0]),
            loss_factor=rng.choice([None, 1.5, 2.7, 4.0]),
            warmup=warmup,
            decay=rng.choice([0.98, 0.9, 0.5, 0.123456789, 0.999]),
            action=rng.choice(["skip", "warn"])),
        zclip=ampguard.ZClip(z=rng.choice([2.5, 1.0, 3.3, 0.3]), alpha=rng.choice([0.97, 0.5, 0.123456789, 0.999]),
                             warmup=warmup) if zclip else None,
        clip_grad_norm=None if zclip else rng.choice([None, 1.0, 0.05, 0.3, 1e-3, 7.77]),
        hysteresis=rng.choice([1, 1, 2, 3]),
        min_scale=min_scale,
        max_scale=rng.choice([None, None, min_scale, min_scale * 1000.3, 2.0**24, 65536.0]),
        **rng.choice([{}, {}, {"scale_policy": "headroom", "numerics_every": 3,
                               "headroom_margin_log2": rng.choice([0, 2, 7])}]),
    )


def rand_carried(rng: random.Random) -> Carried:
    return Carried(
        grad_ema=f32(rng.choice([0.0, rng.uniform(0, 10), math.exp(rng.uniform(-10, 10)), math.nan, math.inf])),
        loss_ema=f32(rng.choice([0.0, rng.uniform(0, 5), math.nan])),
        count=rng.choice([0, 0, 1, 2, 3, 25]),
        overflow_run=rng.choice([0, 0, 1, 2]),
        scale=rng.choice([None, 65536.0, 4096.0, 1.0, 2.0**127, F32_MAX, f32(0.3), 2.0**-20, f32(rng.uniform(0, 1e6))]),
        tracker=rng.choice([0, 1, 2, 4, 1999]),
        growth_factor=rng.choice([2.0, 1.5, 3.3, 1.0000001]),
        backoff_factor=rng.choice([0.5, 0.3, 0.77, 0.123456789]),
        growth_interval=rng.choice([1, 2, 3, 5, 2000]),
        z_mean=f32(rng.choice([0.0, rng.uniform(0, 10), math.exp(rng.uniform(-10, 10)), math.nan, math.inf])),
        z_var=f32(rng.choice([0.0, rng.uniform(0, 4), math.exp(rng.uniform(-20, 20)), math.nan, math.inf])),
        clip_mean=f32(rng.choice([0.0, rng.uniform(0, 10), math.exp(rng.uniform(-10, 10)), math.nan])),
        clip_var=f32(rng.choice([0.0, rng.uniform(0, 4), math.exp(rng.uniform(-20, 20)), math.inf])),
        clip_count=rng.choice([0, 0, 1, 2, 3, 25]),
        flag_run=rng.choice([0, 0, 1, 2, 19]),
        flag_norm_mean=f32(rng.choice([0.0, rng.uniform(0, 10), math.exp(rng.uniform(-10, 10)), math.nan])),
        flag_norm_var=f32(rng.choice([0.0, rng.uniform(0, 4), math.exp(rng.uniform(-20, 20)), math.inf])),
        flag_loss_mean=f32(rng.choice([0.0, rng.uniform(0, 5), math.nan])),
        clip_run=rng.choice([0, 0, 1, 2, 19]),
        clip_flag_mean=f32(rng.choice([0.0, rng.uniform(0, 10), math.exp(rng.uniform(-10, 10))])),
        clip_flag_var=f32(rng.choice([0.0, rng.uniform(0, 4), math.exp(rng.uniform(-20, 20))])),
    )


# ---------------------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("seed", range(8))
def test_random_single_decisions_agree(seed):
    rng = random.Random(seed)
    for _ in range(120):
        world = rng.choice([1, 1, 2, 3, 4, 8])
        g = torch.tensor([rand_row(rng, p_bad=rng.choice([0.0, 0.2, 0.6])) for _ in range(world)],
                         dtype=torch.float32)
        run_both(g, rand_config(rng), rand_carried(rng), sharded=world > 1 and rng.random() < 0.5)


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_agree_with_state_carried(seed):
    """Runs of steps: warm-up then spikes, hysteresis runs, growth at the interval, the floor."""
    rng = random.Random(100 + seed)
    for _ in range(6):
        config = rand_config(rng)
        carried = rand_carried(rng)
        world = rng.choice([1, 2, 4])
        sharded = world > 1 and rng.random() < 0.5
        base = rng.uniform(0.5, 3)
        for _ in range(40):
            rows = []
            for _ in range(world):
                row = rand_row(rng, p_bad=0.15)
                if rng.random() < 0.7:  # mostly healthy, similar norms, with the odd spike
                    row[Loc.GRAD_NORM] = base * rng.uniform(0.8, 1.2) * (rng.choice([1, 1, 1, 5, 50]))
                    row[Loc.LOSS] = base * rng.uniform(0.9, 1.1) * rng.choice([1, 1, 1, 3, 30])
                rows.append(row)
            carried = run_both(torch.tensor(rows, dtype=torch.float32), config, carried, sharded)


def clean(world: int = 1, **cols: float) -> torch.Tensor:
    row = [0.0] * LOCAL_K
    row[Loc.LOSS] = row[Loc.GRAD_NORM] = 1.0
    for k, v in cols.items():
        row[getattr(Loc, k.upper())] = v
    return torch.tensor([row] * world, dtype=torch.float32)


@pytest.mark.parametrize("world", [1, 2, 5])
@pytest.mark.parametrize("col", range(LOCAL_K))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, F32_MAX, 1.0])
def test_a_special_value_in_any_column_on_any_rank(world, col, value):
    config = GuardConfig(spikes=ampguard.Spikes(grad_factor=2.0, loss_factor=2.0, warmup=1, action="skip"),
                         clip_grad_norm=0.5)
    for rank in range(world):
        g = clean(world)
        g[rank, col] = value
        run_both(g, config, Carried(grad_ema=1.0, loss_ema=1.0, count=3))
        run_both(g, config, Carried(grad_ema=1.0, loss_ema=1.0, count=3, scale=None), sharded=world > 1)


def ulp_step(x: float, n: int) -> float:
    """The float32 ``n`` steps from ``x`` (positive ``x``)."""
    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] + n))[0]


def test_spike_thresholds_exactly():
    """At the threshold, a float32 ulp either side, and where the threshold's own rounding (of the
    factor, and of the product, up or down) decides: float32 ``factor * ema``, strict ``>``."""
    rng = random.Random(3)
    for factor in (3.3, 2.7, 1.0000001, 10.0):
        config = GuardConfig(spikes=ampguard.Spikes(grad_factor=factor, loss_factor=factor, warmup=1, action="skip"))
        for _ in range(40):
            ema = f32(rng.uniform(0.1, 10))
            at = f32(f32(factor) * ema)
            for norm in (ulp_step(at, -1), at, ulp_step(at, 1), f32(factor * ema)):
                run_both(clean(grad_norm=norm, loss=norm), config, Carried(grad_ema=ema, loss_ema=ema, count=1))
    # warm-up boundary: count == warmup - 1 is not warm, count == warmup is
    config = GuardConfig(spikes=ampguard.Spikes(grad_factor=2.0, warmup=5, action="skip"))
    for count in (4, 5):
        run_both(clean(grad_norm=100.0), config, Carried(grad_ema=1.0, count=count))


def test_growth_interval_boundary_floor_and_ceiling():
    config = GuardConfig(min_scale=1.0, max_scale=2.0**20)
    for tracker in (0, 1, 2, 3):  # growth_interval 3: grows when the tracker reaches it
        run_both(clean(), config, Carried(scale=1024.0, tracker=tracker, growth_interval=3))
        run_both(clean(found_inf=1.0), config, Carried(scale=1024.0, tracker=tracker, growth_interval=3))
    run_both(clean(), config, Carried(scale=2.0**20, tracker=2, growth_interval=3))  # at the ceiling: no growth
    run_both(clean(), config, Carried(scale=2.0**19 * 1.5, tracker=2, growth_interval=3))  # clamped to it
    run_both(clean(found_inf=1.0), config, Carried(scale=1.5))  # backoff below the floor: clamped, floor hit
    run_both(clean(found_inf=1.0), config, Carried(scale=1.0))
    run_both(clean(), GuardConfig(), Carried(scale=2.0**127, tracker=0, growth_interval=1))  # grows to inf: no
    run_both(clean(), GuardConfig(), Carried(scale=F32_MAX, tracker=0, growth_interval=1, growth_factor=1.0000001))
    # bounds that float32 rounds up (f32(0.1) > 0.1): the comparisons are against the rounded bound
    for k in (0, 14):
        bound = 0.1 * 2.0**k
        run_both(clean(found_inf=1.0), GuardConfig(min_scale=bound), Carried(scale=f32(bound) * 2))
        run_both(clean(), GuardConfig(min_scale=bound / 1024, max_scale=bound),
                 Carried(scale=f32(bound) / 2, tracker=0, growth_interval=1))
    # a non-overflow skip (non-finite loss, finite gradients) holds scale and tracker
    run_both(clean(loss=math.nan, loss_nonfinite=1.0), config, Carried(scale=8.0, tracker=2, growth_interval=3))


def test_hysteresis_allowance_refills_only_on_growth():
    """hysteresis=3 on both paths: the first two overflows after a growth back nothing off, a clean
    step between them refills nothing, every later overflow backs off, and a growth (4 clean steps)
    refills the allowance (DeepSpeed's and Megatron-LM's rule; docs/hysteresis.md)."""
    config = GuardConfig(hysteresis=3)
    carried = Carried(scale=4096.0, growth_interval=4)
    pattern = [1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1, 1]
    expect = [4096, 4096, 4096, 2048, 1024, 1024, 1024, 1024, 2048, 2048, 2048, 2048, 1024, 512]
    seen = []
    for bad in pattern:
        carried = run_both(clean(found_inf=float(bad)), config, carried)
        seen.append(carried.scale)
    assert seen == expect


def test_sequences_match_the_scale_rule_step_by_step():
    """The scale rule on host values against the same rule on tensors, over long random runs of
    overflow/held/clean (and of sampled headroom, for the headroom policy)."""
    rng = random.Random(7)
    cpu = TensorOps(torch.device("cpu"))
    for _ in range(40):
        kw = dict(hysteresis=rng.choice([1, 2, 3]), growth_factor=rng.choice([2.0, 1.5, 3.3]),
                  backoff_factor=rng.choice([0.5, 0.3, 0.77]), growth_interval=rng.choice([1, 2, 3, 7]),
                  margin=rng.choice([0, 2, 5]))
        kw["min_scale"], kw["max_scale"] = rng.choice([(1.0, None), (0.1, 1000.3), (2.0**-10, 2.0**16)])
        headroom_policy = rng.random() < 0.3
        scale, tracker, run = f32(rng.choice([1.0, 512.0, 0.7, 999.9])), 0, 0
        for _ in range(60):
            overflow = rng.random() < 0.3
            held = not overflow and rng.random() < 0.1
            headroom = None
            if headroom_policy:
                headroom = f32(rng.choice([math.nan, math.inf, rng.uniform(-200, 200), rng.uniform(0, 12)]))
            t = next_scale(cpu, scale=torch.tensor(scale), growth_tracker=torch.tensor(tracker, dtype=torch.int32),
                           overflow=torch.tensor(overflow), held=torch.tensor(held),
                           overflow_run=torch.tensor(run, dtype=torch.int32),
                           headroom=None if headroom is None else torch.tensor(headroom), **kw)
            h = next_scale(HOST, scale=scale, growth_tracker=tracker, overflow=overflow, held=held, overflow_run=run,
                           headroom=headroom, **kw)
            assert bits(h[0]) == bits(t[0].item())
            assert tuple(h[1:]) == (int(t[1]), bool(t[2]), bool(t[3]), bool(t[4]), int(t[5]))
            scale, tracker, run = h[0], h[1], h[5]


@pytest.mark.parametrize("seed", range(3))
def test_local_vector_packs_the_same_on_host_and_device(seed):
    rng = random.Random(seed)
    for _ in range(60):
        n = rng.choice([0, 1, 3, 10])
        norms = torch.tensor([rand_value(rng, nonneg=True) if rng.random() < 0.3 else rng.uniform(0, 5)
                              for _ in range(n)], dtype=torch.float32)
        loss = rng.choice([None, torch.tensor(rand_value(rng), dtype=torch.float32)])
        found = rng.choice([None, torch.tensor(0.0), torch.tensor(1.0), torch.tensor([1.0])])  # [1]: Sharded
        pre = rng.choice([None, torch.tensor(0.0), torch.tensor(1.0)])
        kw = dict(loss=loss, tensor_norms=norms, found_inf=found, pre_reduction=pre, device=torch.device("cpu"),
                  no_grads=rng.random() < 0.2)
        a, b = local_vector(**kw, host=False).tolist(), local_vector(**kw, host=True).tolist()  # type: ignore[arg-type]
        assert [bits(x) for x in a] == [bits(x) for x in b], (a, b, norms, loss)
        if n:  # the reductions made beforehand (in the measurement's graph on CUDA): the same vector
            c = local_vector(**kw, host=False, reductions=total_and_nonfinite(norms)).tolist()  # type: ignore[arg-type]
            assert [bits(x) for x in c] == [bits(x) for x in b], (c, b, norms, loss)


# ---------------------------------------------------------------------------------------- end to end


def both_paths(make, steps, fault=None, run=None):
    """The same guarded run twice on CPU: host decision (the default) and the tensor path."""
    runs = []
    for host in (True, False):
        model = make_model()
        opt = make(model)
        assert opt._pipeline.host_decision  # CPU default
        opt._pipeline.host_decision = host
        if run is not None:
            run(opt, model)
        elif fault is None:
            guarded_steps(opt, model, make_data(steps))
        else:
            with faults.inject(opt, fault):
                guarded_steps(opt, model, make_data(steps))
        runs.append((snapshot(model, opt), opt.history, opt.anomalies, opt.get_scale(), opt.state_dict()["ampguard"]))
    (sa, ha, aa, ca, ga), (sb, hb, ab, cb, gb) = runs
    assert_same(sa, sb)
    assert ca == cb
    assert _nan_eq([dataclasses.asdict(dataclasses.replace(r, wall_time=0.0)) for r in ha],
                   [dataclasses.asdict(dataclasses.replace(r, wall_time=0.0)) for r in hb])
    assert list(aa) == list(ab)
    assert _nan_eq(ga, gb)
    return ha


def _nan_eq(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_nan_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_nan_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return bits(a) == bits(b)
    return bool(a == b)


@pytest.mark.parametrize("kind", ["adamw", "adamw_fused", "sgd"])
def test_guard_runs_the_same_on_both_paths(kind):
    cfg = dict(spikes=ampguard.Spikes(grad_factor=1.5, loss_factor=1.5, warmup=2, action="skip"), hysteresis=2)
    def make(m):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
        return ampguard.wrap(make_opt(m, kind), model=m, precision="fp16", config=cfg, scaler=scaler)

    hist = both_paths(make, 24, faults.grad("0.weight", "inf", steps=[4, 5, 6, 9]))
    assert any(r.skipped for r in hist) and any(not r.skipped for r in hist)
    assert len({r.loss_scale for r in hist}) > 1


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_guard_runs_the_same_on_both_paths_without_a_scaler(precision):
    both_paths(lambda m: ampguard.wrap(make_opt(m, "adamw"), model=m, precision=precision,
                                       config={"clip_grad_norm": 0.05}), 10, faults.loss("nan", steps=[3]))


def test_clip_on_both_paths():
    hist = both_paths(lambda m: ampguard.wrap(make_opt(m), model=m, precision="fp16",
                                              config={"clip_grad_norm": 2.5}), 16)
    assert any(r.clip_coef < 1.0 for r in hist) and any(r.clip_coef == 1.0 for r in hist)


@pytest.mark.parametrize("kind", ["adamw", "adamw_fused", "sgd"])
def test_a_step_without_gradients_on_both_paths(kind):
    def run(opt, model):
        data = make_data(4)
        guarded_steps(opt, model, data[:2])
        with opt.autocast():
            loss = loss_of(model, *data[2]).detach().requires_grad_()  # reaches no parameter
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        guarded_steps(opt, model, data[3:])

    hist = both_paths(lambda m: ampguard.wrap(make_opt(m, kind), model=m, precision="fp16",
                                              scaler=torch.amp.GradScaler("cpu", init_scale=1024.0),
                                              config={"spikes": {"grad_factor": 5.0, "warmup": 1}}), 0, run=run)
    assert [r.reason for r in hist] == [None, None, "no_gradients", None]


def test_a_fused_optimizer_of_the_older_grad_scaler_protocol_is_stepped_by_grad_scaler():
    class OldFused(torch.optim.SGD):
        _step_supports_amp_scaling = True
        seen: list = []

        def step(self, closure=None, grad_scaler=None):
            self.seen.append(grad_scaler)
            return super().step(closure)

    model = make_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = ampguard.wrap(OldFused(model.parameters(), lr=0.1), model=model, precision="fp16", scaler=scaler)
    with pytest.warns(FutureWarning, match="stop passing itself"):
        guarded_steps(opt, model, make_data(2))
    assert OldFused.seen == [scaler, scaler]


def test_the_host_path_is_the_cpus():
    """Host decision: on the CPU; off the CPU the tensor path, a fused optimizer's (no sync) and, since stop 55, a
    non-fused one's (its one sync reads the decision's skip flag: tests/unit/test_unfused_fast.py, which also
    checks ``AMPGUARD_UNFUSED_HOST_DECISION=1``, the host path as before)."""
    model = make_model()
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16")
    assert opt._pipeline.host_decision is True
    decided, decide = [], opt._pipeline.decide
    opt._pipeline.decide = lambda *a, **k: decided.append(decide(*a, **k)) or decided[-1]  # type: ignore[method-assign]
    guarded_steps(opt, model, make_data(2))
    assert len(decided) == 2 and all(d.host is not None for d in decided)  # the host path ran
    other = torch.device("meta")  # any other device
    fused = StepPipeline(optimizer=make_opt(make_model(), "adamw_fused"), adapter=None, backend=LocalBackend(),
                         config=GuardConfig(), device=other)
    assert fused.host_decision is False
    assert fused.spikes.count.device == other  # its carried state on the device
    unfused = StepPipeline(optimizer=make_opt(make_model()), adapter=None, backend=LocalBackend(),
                           config=GuardConfig(), device=other)
    assert unfused.host_decision is False
    assert unfused.spikes.count.device == unfused.scale_state.overflow_run.device == other


@pytest.mark.parametrize("seed", range(3))
def test_zscore_and_zclip_sequences_agree(seed):
    """A noisy healthy norm with spikes and non-finite steps: the z-score detector warms up and
    flags, ZClip warms up and clips, on both paths, with the same statistics after every step."""
    rng = random.Random(200 + seed)
    warmup = rng.choice([3, 10])
    config = GuardConfig(spikes=ampguard.Spikes(grad_zscore=3.0, window=rng.choice([5, 20]), warmup=warmup,
                                                action=rng.choice(["skip", "warn"])),
                         zclip=ampguard.ZClip(warmup=warmup, z=2.5, alpha=rng.choice([0.97, 0.9])))
    carried, flagged, clipped = Carried(), 0, 0
    for i in range(80):
        norm = rng.gauss(2.0, 0.2) * (rng.choice([10.0, 100.0]) if i > 12 and rng.random() < 0.1 else 1.0)
        cols = {"grad_norm": norm, "loss": rng.uniform(1, 2)}
        if rng.random() < 0.05:
            cols.update(grad_norm=math.inf, found_inf=1.0)
        carried = run_both(clean(**cols), config, carried)
        flagged += carried.last[Dec.GRAD_SPIKE] > 0
        clipped += carried.last[Dec.CLIP_COEF] < 1.0
    assert flagged > 0 and clipped > 0


_CONFIGS = {
    "default": {},
    "clip+zscore": {"clip_grad_norm": 0.05, "spikes": {"grad_zscore": 4.0, "warmup": 3}},
    "numerics+indicators+headroom": {"numerics_every": 3, "indicators_every": 3, "scale_policy": "headroom"},
    "huge-growth-interval": {},
    # thresholds low enough that runs of flags re-base the detectors' and ZClip's statistics
    "rebaseline": {"spikes": {"grad_zscore": 0.1, "warmup": 2, "action": "skip"}, "zclip": {"warmup": 2, "z": 0.1}},
}


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_the_one_host_copy_path_decides_and_reports_as_the_cpu_path(name, monkeypatch):
    """A non-fused optimizer off the CPU decides on the host from ONE copy of the gathered
    statistics, norms, sampled numerics, scale and growth tracker (``pipeline.HostCopy``), and its
    report is built from that copy. CI has no GPU: this runs that path on the CPU (``host_copies``: the
    local vector made on device, the one copy, the payload packed from it) and asserts the run is bit for
    bit the CPU path's (parameters, optimizer state, scale, every report field), through natural fp16
    overflows, injected infs, clipping, sampled numerics and indicators."""
    from ampguard import faults
    from ampguard.payload import HostCopy

    def run(force: bool):
        read = HostCopy.read
        copies = []
        if force:
            def counted(*a, **k):
                copies.append(k.get("copy"))
                return read(*a, **k)
            monkeypatch.setattr(HostCopy, "read", counted)
        model = make_model()
        interval = 2**25 if name == "huge-growth-interval" else 3
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=interval)
        opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", scaler=scaler,
                            config={"param_norms_every": 1, **_CONFIGS[name]})
        opt._pipeline.host_copies = force  # CUDA's host decision, on the CPU
        faults.inject(opt, faults.grad("0.weight", "inf", steps=[4]))
        guarded_steps(opt, model, make_data(14))
        opt.flush()
        monkeypatch.setattr(HostCopy, "read", read)
        return model, opt, copies

    ref_model, ref_opt, _ = run(False)
    model, opt, copies = run(True)
    assert copies == [True] * 14  # every step decided from the one copy
    assert_same(snapshot(ref_model, ref_opt), snapshot(model, opt))
    assert opt.get_scale() == ref_opt.get_scale()

    def fields(r):
        d = dataclasses.asdict(r)
        d.pop("wall_time")
        return repr(d)  # NaN-safe comparison of every field

    assert [fields(r) for r in opt.history] == [fields(r) for r in ref_opt.history]
    assert any(r.skipped for r in opt.history) and not all(r.skipped for r in opt.history)
    if name.startswith("numerics"):
        assert any(r.module_grad_norms for r in opt.history) and any(r.headroom_log2 for r in opt.history)
    if name == "rebaseline":
        kinds = [(a.step, a.kind, a.detail) for a in opt.anomalies]
        assert kinds == [(a.step, a.kind, a.detail) for a in ref_opt.anomalies]
        assert {d.split(" ")[0] for _, k, d in kinds if k == "rebaseline"} == {"the", "ZClip"}


@pytest.mark.parametrize("config", [
    GuardConfig(spikes=ampguard.Spikes(grad_factor=3.0, loss_factor=2.0, warmup=4, action="skip"),
                zclip=ampguard.ZClip(warmup=4)),
    GuardConfig(spikes=ampguard.Spikes(grad_zscore=4.0, window=5, warmup=3, action="warn"),
                zclip=ampguard.ZClip(warmup=3, z=1.0)),
], ids=["factor+loss+zclip", "zscore+zclip"])
def test_a_lasting_shift_re_bases_the_statistics_on_both_paths(config):
    """A norm and loss that jump x10 for good, with non-finite steps inside the flagged run (they
    neither extend nor end it) and a lone spike before: both paths re-base the detectors' and
    ZClip's statistics on the same step, to the same bits (docs/detectors.md)."""
    rng = random.Random(5)
    carried, rebased, zrebased = Carried(), [], []
    for i in range(40):
        level = 10.0 if i >= 20 else 1.0
        cols = {"grad_norm": level * rng.uniform(0.9, 1.1), "loss": level * rng.uniform(0.95, 1.05)}
        if i == 12:
            cols = {"grad_norm": 50.0, "loss": 50.0}
        if i in (21, 22):
            cols.update(grad_norm=math.inf, found_inf=1.0)
        carried = run_both(clean(**cols), config, carried)
        if carried.last[Dec.REBASELINE] > 0:
            rebased.append(i)
        if carried.last[Dec.ZCLIP_REBASELINE] > 0:
            zrebased.append(i)
    k = config.spikes.warmup
    assert rebased[:1] == zrebased[:1] == [20 + k + 1]  # k flagged steps, the two non-finite ones not counted
    assert carried.grad_ema > 5 or carried.z_mean > 5


def test_a_loss_nobody_gave_leaves_the_loss_statistics_as_they_are_on_both_paths():
    """``scaler.scale(loss).backward(); opt.step()`` with a spike detector on: the guard never sees
    the loss (``StepReport.loss`` is None, the gathered loss NaN). Before, that NaN went into the
    loss EMA on every taken step, so the guard's own ``state_dict()`` could not be loaded back
    ("loss_ema is nan"). Both paths now keep the loss statistics and resume bit for bit."""
    cfg = dict(spikes=ampguard.Spikes(grad_factor=3.0, warmup=2, action="skip"))

    def make(m):
        return ampguard.wrap(make_opt(m), model=m, precision="fp16", config=cfg,
                             scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))

    def unseen_loss(opt, model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the guard's warning about the unseen loss
            for x, y in make_data(8):
                with opt.autocast():
                    loss = loss_of(model, x, y)
                opt.scaler.scale(loss).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    hist = both_paths(make, 8, run=unseen_loss)
    assert [r.loss for r in hist] == [None] * 8 and not any(r.skipped for r in hist)
    model = make_model()
    opt = make(model)
    unseen_loss(opt, model)
    state = opt.state_dict()
    assert math.isfinite(state["ampguard"]["loss_ema"]) and state["ampguard"]["ema_count"] == 8
    other = make_model()
    again = make(other)
    again.load_state_dict(state)  # raised "loss_ema is nan; expected a finite number" before


def test_each_rule_is_written_once():
    """One decision rule and one scale rule, each run on either execution of ``ampguard.ops``:
    no host twin of a rule (``*_host``) is left beside it. (Before: ``decide_host``,
    ``_zclip_host``, ``_fold_host``, ``_flag_run_host``, ``_window_weight_host`` beside the tensor
    rule, and ``next_scale_host``/``headroom_target_host`` beside ``next_scale``.)"""
    import ast
    import inspect
    import textwrap

    from ampguard import policies, scale_rule, scaling, shared_scaler

    twins = [f"{m.__name__}.{name}" for m in (policies, scale_rule, scaling, shared_scaler)
             for name, fn in vars(m).items() if name.endswith("_host") and inspect.isfunction(fn)
             and name != "decide_host"]
    assert twins == []
    # decide_host and decide are entry points into the one rule, nothing more
    for entry in (policies.decide, policies.decide_host):
        body = ast.parse(textwrap.dedent(inspect.getsource(entry))).body[0].body  # type: ignore[attr-defined]
        call = body[-1].value
        assert len(body) == 2 and isinstance(call, ast.Call) and call.func.id == "rule", entry
