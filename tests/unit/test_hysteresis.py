"""Hysteresis that backs off under intermittent overflow (docs/hysteresis.md), on real fp16 overflows.

The overflows here are genuine: a batch whose targets are 10**3 (or 10**6) times the others gives
an output gradient ``2 * (pred - y) / N * scale`` beyond fp16's 65504 at the Linear's fp16 output,
in backward, so GradScaler finds inf. Before the fix, with ``hysteresis=2`` and such a batch on
every other step, half the steps were skipped for ever and the scale never moved (the allowance
refilled on every clean step); a burst of k overflows backed off floor(k/h) times. Now the
allowance refills only when the scale grows (DeepSpeed's and Megatron-LM's rule): the scale backs
off until the batches fit, and a burst of k backs off k - h + 1 times. ``hysteresis=1`` stays
GradScaler's rule bit for bit, overflows included (test_guard.py's
test_fp16_bitwise_identical_to_plain_gradscaler_loop, through natural overflows).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import ampguard

from ._models import guarded_steps, make_data, make_model, make_opt

INIT = 1024.0
_SPEC = importlib.util.spec_from_file_location(
    "hysteresis_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "hysteresis.py")
assert _SPEC is not None and _SPEC.loader is not None
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def batches(n: int, big: set[int], factor: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x, y * factor) if i in big else (x, y) for i, (x, y) in enumerate(make_data(n))]


def guarded(data, *, hysteresis: int, growth_interval: int = 10_000,
            model: torch.nn.Module | None = None) -> ampguard.GuardedOptimizer:
    model = make_model() if model is None else model
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=growth_interval)
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", scaler=scaler,
                        config={"hysteresis": hysteresis})
    guarded_steps(opt, model, data)
    return opt


def test_alternating_overflows_back_the_scale_off_until_the_batches_fit():
    n = 40
    opt = guarded(batches(n, {i for i in range(n) if i % 2}, 1e3), hysteresis=2)
    h = list(opt.history)
    overflowed = [r.step for r in h if r.nonfinite_grads]
    assert overflowed[:2] == [1, 3]  # genuine overflows, on the odd steps
    backoffs = [r.step for r in h if r.scale_backoff]
    assert backoffs and backoffs[0] == 3  # the second overflow backs off: the clean step between refills nothing
    assert opt.get_scale() < INIT
    # the scale came down to where the odd batches fit: in the second half only the odd larger one
    # overflows (and backs off again); before the fix, every odd step there was skipped at 1024
    assert sum(r.skipped for r in h[n // 2:]) <= 2
    assert len(backoffs) == len(overflowed) - 1  # every overflow after the first backed off


@pytest.mark.parametrize(("k", "hysteresis"), [(5, 2), (3, 2), (4, 3), (6, 3)])
def test_a_burst_of_k_overflows_backs_off_k_minus_h_plus_1_times(k, hysteresis):
    start = 4
    data = batches(start + k + 4, set(range(start, start + k)), 1e6)  # overflows at every scale >= 1/8
    opt = guarded(data, hysteresis=hysteresis)
    h = list(opt.history)
    assert [r.step for r in h if r.nonfinite_grads] == list(range(start, start + k))
    expected = max(k - hysteresis + 1, 0)
    assert sum(r.scale_backoff for r in h) == expected
    assert opt.get_scale() == INIT / 2**expected


def test_a_growth_refills_the_allowance():
    # a burst of 3 (h=2: 2 backoffs), calm long enough to grow once, then two lone overflows: the
    # first is absorbed by the refilled allowance, the second backs off although steps came between
    big = {2, 3, 4, 12, 15}
    opt = guarded(batches(18, big, 1e6), hysteresis=2, growth_interval=5)
    h = {r.step: r for r in opt.history}
    assert [s for s in sorted(h) if h[s].scale_backoff] == [3, 4, 15]
    assert [s for s in sorted(h) if h[s].scale_growth] == [9]
    assert not h[12].scale_backoff and h[12].skipped


def test_the_rule_is_megatrons_and_deepspeeds_on_every_pattern_of_the_benchmark():
    """ampguard's real rule against the benchmark's reimplementations of theirs: Megatron-LM's
    trajectory exactly; DeepSpeed's (consecutive_hysteresis=False) exactly when nothing grows (its
    growth waits one step longer), and the same backoff count on every pattern."""
    for name, pattern in bench.patterns(40).items():
        ours = bench.ampguard_trajectory(pattern, hysteresis=2, growth_interval=6)
        assert ours == bench.megatron_trajectory(pattern, hysteresis=2, growth_interval=6), name
        still = bench.ampguard_trajectory(pattern, hysteresis=3, growth_interval=1000)
        assert still == bench.deepspeed_trajectory(pattern, hysteresis=3, growth_interval=1000, consecutive=False)
        before = bench.old_ampguard_trajectory(pattern, hysteresis=2, growth_interval=6)
        if name == "alternating":  # the failing case: the old rule never backed off
            assert before[-1] == bench.INIT and ours[-1] < bench.INIT / 2**10


@pytest.mark.parametrize("field", ["hysteresis", "spikes.warmup", "zclip.warmup"])
def test_a_count_beyond_int32_is_refused_by_name(field):
    # the allowance and the flagged runs are int32 device counters: refused at construction
    part, _, name = field.partition(".")
    with pytest.raises(ValueError, match=rf"GuardConfig\.{field}=2147483648; allowed: an int in 1\.\.2147483647"):
        ampguard.GuardConfig.from_dict({part: {name: 2**31}} if name else {part: 2**31})
    ok = ampguard.GuardConfig.from_dict({part: {name: 2**31 - 1}} if name else {part: 2**31 - 1})
    assert (getattr(getattr(ok, part), name) if name else getattr(ok, part)) == 2**31 - 1


@pytest.mark.parametrize("host", [True, False])
def test_hysteresis_one_carries_the_overflow_run_as_the_general_rule_does(host):
    """``hysteresis=1`` takes a shorter form of the rule (stop 58: one op on device where the general one takes five);
    the run it carries is the general rule's, ``min(run + 1, 1)`` after an overflow and 0 after a growth, on the host
    decision and on the tensor decision (CUDA's, run on the CPU), so a checkpoint saved with it resumes under a
    larger hysteresis as one saved by the general rule would. Genuine overflows (targets 1e6 times the others)."""
    def run(big: set[int], n: int, growth_interval: int) -> ampguard.GuardedOptimizer:
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=growth_interval)
        opt = ampguard.wrap(make_opt(model), model=model, precision="fp16", scaler=scaler, config={"hysteresis": 1})
        opt._pipeline.host_decision = host  # False: the tensor decision, as on CUDA
        guarded_steps(opt, model, batches(n, big, 1e6))
        return opt

    after_burst = run({3, 4}, 6, 10_000)
    assert [r.step for r in after_burst.history if r.scale_backoff] == [3, 4]  # every overflow backs off
    assert after_burst.state_dict()["ampguard"]["overflow_run"] == 1
    grown = run({3}, 10, 3)  # the overflow at 3, then three clean steps grow the scale at 6: the run is reset
    assert any(r.scale_growth for r in grown.history if r.step > 3)
    assert grown.state_dict()["ampguard"]["overflow_run"] == 0
