"""fp8 cast statistics of real torchao float8 training (CPU: Float8LinearConfig(emulate=True)), measured by
ampguard.fp8.Fp8Monitor's hooks: real NaN/Inf inputs, a real underflowing grad_output, and a healthy run that the
monitoring leaves bitwise unchanged."""

from __future__ import annotations

import copy
import math

import pytest
import torch

torchao_float8 = pytest.importorskip("torchao.float8")

from ampguard._versions import IntegrationVersionError, check_version  # noqa: E402
from ampguard.fp8 import Fp8Monitor  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


def _model(recipe: str = "tensorwise") -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(16, 32))
    model.add_module("act", torch.nn.ReLU())
    model.add_module("fc2", torch.nn.Linear(32, 16))
    if recipe == "rowwise":
        config = torchao_float8.Float8LinearConfig.from_recipe_name("rowwise")
        config = torchao_float8.Float8LinearConfig(**{**vars(config), "emulate": True})
    else:
        config = torchao_float8.Float8LinearConfig(emulate=True)
    return torchao_float8.convert_to_float8_training(model, config=config)


def _step(model: torch.nn.Module, monitor: Fp8Monitor, x: torch.Tensor, step: int = 0, loss_scale: float = 1.0):
    monitor.begin_step(step)
    (model(x).square().mean() * loss_scale).backward()
    collected = monitor.collect()
    return collected, monitor.nonfinite(collected), monitor.decode(collected.tolist())


def test_a_nan_input_makes_a_nonfinite_cast_named_by_module_and_role():
    model = _model()
    monitor = Fp8Monitor(model, numerics_every=1)
    x = torch.randn(8, 16)
    x[3, 5] = math.nan  # a real NaN in the batch
    _, flag, casts = _step(model, monitor, x)
    assert flag.item() == 1.0 and flag.device == x.device and flag.dim() == 0
    bad = {(c.module, c.role) for c in casts if not c.finite}
    assert ("fc1", "input") in bad and ("fc1", "weight") not in bad
    first = next(c for c in casts if (c.module, c.role) == ("fc1", "input"))
    assert math.isnan(first.amax) and math.isnan(first.scale)
    assert Fp8Monitor.describe(first) == "fc1, input: amax nan → scale nan"


def test_an_inf_row_under_the_rowwise_recipe_zeroes_that_rows_scale_and_is_named():
    model = _model("rowwise")
    monitor = Fp8Monitor(model, numerics_every=1)
    x = torch.randn(8, 16)
    x[2, 0] = math.inf  # torchao: scale = max / amax = 0 for that row, which zeroes it
    _, flag, casts = _step(model, monitor, x)
    assert flag.item() == 1.0
    cast = next(c for c in casts if (c.module, c.role) == ("fc1", "input"))
    assert cast.amax == math.inf and cast.scale == 0.0
    assert Fp8Monitor.describe(cast) == "fc1, input: amax inf → scale 0"


def test_an_underflowing_grad_output_is_reported_on_sampled_steps_only():
    model = _model()
    monitor = Fp8Monitor(model, numerics_every=2)
    x = torch.randn(64, 16)
    _, flag, casts = _step(model, monitor, x, step=1)  # not sampled: no underflow measured
    assert flag.item() == 0.0 and all(c.underflow is None and c.dynamic_range is None for c in casts)
    model.zero_grad()
    # A loss scaled by 1e-30: grad_output's amax (~1e-32) is below torchao's clamp (1e-12), so the scale stops at
    # finfo(e5m2).max / 1e-12 and every non-zero element becomes 0 in fp8: finite, and all of it lost.
    _, flag, casts = _step(model, monitor, x, step=2, loss_scale=1e-30)
    grad = next(c for c in casts if (c.module, c.role) == ("fc2", "grad_output"))
    assert flag.item() == 0.0 and grad.finite and grad.amax < 1e-30
    assert grad.scale == pytest.approx(torch.finfo(torch.float8_e5m2).max / 1e-12, rel=1e-6)
    assert grad.underflow == 1.0 and grad.dynamic_range is not None
    healthy = next(c for c in casts if (c.module, c.role) == ("fc1", "input"))
    assert healthy.underflow is not None and healthy.underflow < 0.01
    assert grad.saturation is None  # dynamic scaling: nothing is clamped


def test_a_healthy_monitored_run_is_bitwise_the_unmonitored_one():
    plain = _model()
    watched = copy.deepcopy(plain)
    monitor = Fp8Monitor(watched, numerics_every=1)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, watched)]
    torch.manual_seed(1)
    batches = [torch.randn(8, 16) for _ in range(4)]
    for step, x in enumerate(batches):
        monitor.begin_step(step)
        for model, opt in zip((plain, watched), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        assert monitor.nonfinite(monitor.collect()).item() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), watched.state_dict().values()))
    monitor.close()
    assert not any(m._forward_hooks or m._backward_hooks for m in watched.modules())


def test_an_untested_torchao_version_is_refused_with_the_range():
    refusal = r"torchao >=0\.18,<0\.19; 0\.19\.0 is installed.*ampguard\[fp8\]"
    with pytest.raises(IntegrationVersionError, match=refusal):
        check_version("torchao", "0.19.0")
    check_version("torchao", "0.18.0")


def test_a_model_without_float8_layers_or_a_bad_sampling_period_is_refused():
    with pytest.raises(ValueError, match="convert_to_float8_training"):
        Fp8Monitor(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="numerics_every"):
        Fp8Monitor(_model(), numerics_every=0)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("autocast", [False, True])
def test_an_unsampled_step_measures_the_same_amax_and_scale_with_one_reduction_a_cast(recipe, autocast):
    """Unsampled steps take each cast's amax in one reduction (the autocast rounding and torchao's scale applied to
    all casts at once in collect()); sampled steps run the whole cast_stats. Same batch, same weights: the same
    amax and scale, bitwise, also with a NaN and an Inf in the batch."""
    model = _model(recipe)
    monitor = Fp8Monitor(model, numerics_every=2)
    x = torch.randn(8, 16) * 3
    x[1, 2], x[5, 7] = 1e-3, 7.25e4
    for bad in (None, math.nan, math.inf):
        if bad is not None:
            x[4, 4] = bad
        rows = []
        for step in (0, 1):  # sampled, then not
            monitor.begin_step(step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            out.float().square().mean().backward()
            model.zero_grad()
            rows.append(monitor.collect())
        sampled, unsampled = rows
        assert torch.allclose(sampled[:, :3], unsampled[:, :3], rtol=0, atol=0, equal_nan=True)  # bitwise
        assert monitor.nonfinite(sampled).item() == monitor.nonfinite(unsampled).item() == (bad is not None)
        assert unsampled[:, 3:].isnan().all() and not sampled[:, 3].isnan().any()


def test_a_compiled_model_keeps_one_graph_and_every_cast_is_still_checked(compile_state):
    """Inside torch.compile a gradient hook would break the graph (dynamo cannot trace a hook that writes the
    monitor's state): there the grad_output amax comes back as the gradient of a probe (a pure autograd function),
    so the graph stays one graph, every cast is measured with the eager values, the gradients are bitwise the
    eager ones, nothing recompiles per step, and a NaN in the batch is still flagged. (aot_eager: the compiled
    autograd graphs, without a C++ build.)"""
    _compiled_monitor_checks()


def _compiled_monitor_checks():
    model, eager = _model(), _model()
    monitor, eager_monitor = Fp8Monitor(model, numerics_every=2), Fp8Monitor(eager, numerics_every=2)

    def loss_of(x):
        return model(x).float().square().mean()

    explained = torch._dynamo.explain(loss_of)(torch.randn(8, 16))
    assert explained.graph_count == 1
    assert explained.graph_break_count == 0
    model.zero_grad()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    flags = []
    for step in range(4):
        x = torch.randn(8, 16)
        if step == 3:
            x[1, 1] = math.nan
        rows = []
        for m, mon in ((compiled, monitor), (eager, eager_monitor)):
            mon.begin_step(step)
            m(x).float().square().mean().backward()
            rows.append(mon.collect())
        if step < 3:
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()))
            # every cast, grad_output included, with the eager amax and scale, and on a sampled step (0 and 2) the
            # eager underflow and dynamic range too (grad_output's through the sampled probe)
            assert torch.equal(rows[0][:, :3], rows[1][:, :3])
            if step % 2 == 0:
                assert torch.equal(rows[0][:, 3:], rows[1][:, 3:]) and not rows[0][:, 3:].isnan().any()
            else:
                assert rows[0][:, 3:].isnan().all()
        model.zero_grad()
        eager.zero_grad()
        flags.append(monitor.nonfinite(rows[0]).item())
        assert {c.role for c in monitor.decode(rows[0].tolist())} == {"input", "weight", "grad_output"}
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames <= 2, f"{frames} graphs compiled for 4 steps: one per step would recompile"  # sampled or not
    assert flags == [0.0, 0.0, 0.0, 1.0]
    # An underflowing grad_output inside the compiled graph (the eager test's loss scaled by 1e-30): named on a
    # sampled step, with all of it lost, as eagerly.
    monitor.begin_step(4)
    (compiled(torch.randn(64, 16)).float().square().mean() * 1e-30).backward()
    casts = monitor.decode(monitor.collect().tolist())
    grad = next(c for c in casts if (c.module, c.role) == ("fc2", "grad_output"))
    assert grad.finite and grad.amax < 1e-30 and grad.underflow == 1.0 and grad.dynamic_range is not None
    assert grad.scale == pytest.approx(torch.finfo(torch.float8_e5m2).max / 1e-12, rel=1e-6)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sampled", [True, False])
def test_the_monitors_scales_are_the_ones_torchao_computes_for_each_cast(monkeypatch, recipe, sampled):
    """Under bf16 autocast as torchao sees it on a GPU, the scale the monitor reports for each forward cast is the one
    torchao's own cast computed (read off its result by a spy on ``hp_tensor_to_float8_dynamic``): the input is
    cast to bf16 first, the weight is scaled from its fp32 master (the monitor used to round the weight's amax to
    bf16 as well, so its weight scale could differ from torchao's)."""
    from torchao.float8 import float8_linear

    from tests.unit.test_fp8_compile_cse import _autocast

    real = float8_linear.hp_tensor_to_float8_dynamic
    seen: dict[tuple[int, str], float] = {}

    def spy(hp, *args, **kwargs):
        out = real(hp, *args, **kwargs)
        role = kwargs["gemm_input_role"].value
        key = (hp.shape[-1] if role == "input" else hp.shape[0], role)  # in_features (the weight comes as .t())
        if role in ("input", "weight") and key not in seen:  # the forward's casts come first
            seen[key] = float(out._scale.min())
        return out

    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", spy)
    model = _model(recipe)
    with torch.no_grad():  # weights whose fp32 amax rounds to another bf16 value
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(1.0 + 2.0**-12)
    monitor = Fp8Monitor(model, numerics_every=1 if sampled else 10)
    monitor.begin_step(0 if sampled else 1)
    with _autocast(True):
        loss = model(torch.randn(8, 16)).float().square().mean()
    loss.backward()
    casts = {(c.module, c.role): c.scale for c in monitor.decode(monitor.collect().tolist())}
    width = {"fc1": 16, "fc2": 32}
    for (module, role), scale in casts.items():
        if role != "grad_output":
            assert scale == seen[(width[module], role)], (module, role, scale, seen)


def test_an_unsampled_step_names_a_real_nan_grad_output_from_torchaos_own_amax():
    """On an unsampled step the amax is torchao's own (``ampguard.fp8._Taps``), the grad_output's included: the
    backward of ``sqrt(|y - y.detach()|)`` at 0 (``sqrt``'s infinite slope times ``abs``'s 0 there: 0 * inf) makes a
    real NaN grad_output for fc2, which torchao
    scales to NaN; the monitor names that cast, and no other, on the step itself."""
    from ampguard.fp8 import _TAPS

    model = _model()
    monitor = Fp8Monitor(model, numerics_every=10)
    assert _TAPS.ready()
    monitor.begin_step(3)  # not sampled
    y = model(torch.randn(8, 16))
    (y - y.detach()).abs().sqrt().sum().backward()
    collected = monitor.collect()
    casts = monitor.decode(collected.tolist())
    bad = [(c.module, c.role) for c in casts if not c.finite]
    assert monitor.nonfinite(collected).item() == 1.0 and bad[0] == ("fc2", "grad_output")
    assert all(c.underflow is None for c in casts)  # unsampled: no underflow measured
    cast = next(c for c in casts if (c.module, c.role) == ("fc2", "grad_output"))
    assert math.isnan(cast.amax) and math.isnan(cast.scale)
    monitor.close()


def spy_over_the_taps(monkeypatch) -> None:
    """Someone else's patch over torchao's cast, put in place after a monitor's: the taps are out of the path."""
    from torchao.float8 import float8_linear

    from ampguard.fp8 import _TAPS

    tap = float8_linear.hp_tensor_to_float8_dynamic
    monkeypatch.setattr(float8_linear, "hp_tensor_to_float8_dynamic", lambda *a, tap=tap, **k: tap(*a, **k))
    assert not _TAPS.ready()


def test_where_the_taps_are_not_in_place_the_hooks_measure_the_casts_themselves(monkeypatch):
    """Someone else's patch over torchao's cast (a spy put in place after the monitor) takes the taps out of the
    path: the hooks see it (``_TAPS.ready()``) and measure each cast as before, with the same amax and scale as a
    monitor whose taps are in place, also with a NaN in the batch."""


    x = torch.randn(8, 16) * 3
    x[4, 4] = math.nan
    rows = []
    for spied in (False, True):
        model = _model()
        monitor = Fp8Monitor(model, numerics_every=10)
        if spied:
            spy_over_the_taps(monkeypatch)
        monitor.begin_step(1)
        model(x).square().mean().backward()
        rows.append(monitor.collect())
        monitor.close()
    assert torch.allclose(rows[0][:, :3], rows[1][:, :3], rtol=0, atol=0, equal_nan=True)
    assert rows[0][:, 1].isnan().any()


def test_the_last_monitor_to_close_puts_torchaos_functions_back():
    """The taps are torchao module attributes while a monitor exists, and torchao's own functions again once the last
    one closes (a fresh process: other tests' monitors are not closed)."""
    import subprocess
    import sys

    code = """
import torch
from torchao.float8 import convert_to_float8_training, Float8LinearConfig, float8_linear, float8_utils
from ampguard.fp8 import Fp8Monitor
cast, amax = float8_linear.hp_tensor_to_float8_dynamic, float8_utils.tensor_to_amax
def model():
    linear = torch.nn.Sequential(torch.nn.Linear(16, 16))
    return convert_to_float8_training(linear, config=Float8LinearConfig(emulate=True))
a, b = Fp8Monitor(model()), Fp8Monitor(model())
assert float8_linear.hp_tensor_to_float8_dynamic is not cast and float8_utils.tensor_to_amax is not amax
a.close(); a.close()
assert float8_linear.hp_tensor_to_float8_dynamic is not cast  # b still uses them
b.close()
assert float8_linear.hp_tensor_to_float8_dynamic is cast and float8_utils.tensor_to_amax is amax
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_torchao_without_the_tapped_functions_is_measured_by_the_hooks():
    """Where torchao has no ``tensor_to_amax`` when the first monitor is built (a rename in another release; put back
    before the forward here, which torchao's own cast needs), the monitor is built, the taps are not put in place,
    and the hooks measure every cast themselves: the amax of each forward cast is its tensor's max |x| (a fresh
    process: no monitor of another test has put the taps in place)."""
    import subprocess
    import sys

    code = """
import torch
from torchao.float8 import convert_to_float8_training, Float8LinearConfig, float8_utils
from ampguard.fp8 import Fp8Monitor, _TAPS
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16))
model = convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
amax = float8_utils.tensor_to_amax
del float8_utils.tensor_to_amax
monitor = Fp8Monitor(model, numerics_every=10)
float8_utils.tensor_to_amax = amax
assert not _TAPS.ready()
monitor.begin_step(1)
x = torch.randn(8, 16)
model(x).square().mean().backward()
casts = {c.role: c.amax for c in monitor.decode(monitor.collect().tolist())}
assert casts["input"] == x.abs().max().item() and casts["weight"] == model[0].weight.abs().max().item(), casts
monitor.close()
assert float8_utils.tensor_to_amax is amax
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
