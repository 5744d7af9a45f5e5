"""A sampled fp8 step measures the underflow and the dynamic range on a row sample of a large cast (issue 28: the
sampled underflow was what put the guarded fp8 run over its 1.01x target on the H200): at most ``Fp8Monitor.sample``
elements more are read per cast, beyond the amax every step takes; the amax, the scale and the non-finite flag stay over
the whole tensor. Real torchao float8 training (CPU: ``Float8LinearConfig(emulate=True)``)."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

torchao_float8 = pytest.importorskip("torchao.float8")

from ampguard import fp8  # noqa: E402
from ampguard.fp8 import Fp8Monitor, cast_stats, sample_rows  # noqa: E402
from tests.unit.test_fp8 import _model  # noqa: E402  (16 -> 32 -> 16)

_ROWS = 4096  # the batch: fc1's input is 4096 x 16 (65536 elements), its output gradient 4096 x 32
_SAMPLE = 2048
_VIEWS = {"detach", "view", "_unsafe_view", "slice", "select", "reshape", "t", "transpose", "expand", "as_strided",
          "alias"}
"""Ops that make a view and read nothing."""


class _Reads(TorchDispatchMode):
    """Every aten op run, with the largest number of elements among its tensor inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        sizes = [a.numel() for a in leaves if isinstance(a, torch.Tensor)]
        self.ops[(str(func), max(sizes, default=0))] += 1
        return func(*args, **(kwargs or {}))


def _large_reads(sample: int | str | None, step: int, recipe: str = "tensorwise") -> collections.Counter:
    """The ops of one step of the float8 model that read a tensor of more than ``_ROWS`` elements (more than a row
    sample, ``_SAMPLE`` plus a row, and than the rowwise recipe's row amaxes, one value a row), under a monitor that
    measures (``sample``: its row sample; "off": no monitor; ``step`` 0 sampled)."""
    torch.manual_seed(1)
    model = _model(recipe)
    x = torch.randn(_ROWS, 16)
    if sample != "off":
        monitor = Fp8Monitor(model, numerics_every=2)
        monitor.sample = sample
        monitor.begin_step(step)
    with _Reads() as reads:
        model(x).square().mean().backward()
    if sample != "off":
        monitor.collect()
    return collections.Counter({op: n for op, n in reads.ops.items()
                                if op[1] > _ROWS and op[0].split(".")[1] not in _VIEWS})


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_sampled_step_reads_no_large_cast_again_beyond_its_row_sample(recipe):
    """Over the plain step's ops, a sampled step reads nothing of fc1's and fc2's inputs and grad_outputs (4096 rows)
    beyond their row samples (the weights are 512 elements, under the sample): the amax and the scale are torchao's
    own, handed over by the taps (``ampguard.fp8._Taps``; rowwise, the scale of each sampled row too, or for a
    grad_output the sample's own row amaxes). Before the sample, each of them was copied to float32 and cast again
    whole: a dozen full reads more; until stop 49 a sampled step still took each amax again (one full reduction a
    cast), and an unsampled step until stop 48 (on GPT-2 124M fp8 on an H100, 144 reductions and 3.5 ms a step)."""
    plain = _large_reads("off", 0, recipe)
    sampled = _large_reads(_SAMPLE, 0, recipe)
    unsampled = _large_reads(_SAMPLE, 1, recipe)
    assert not plain - sampled and not plain - unsampled
    assert not sampled - plain, sampled - plain
    assert not unsampled - plain, unsampled - plain


def test_with_no_sample_every_element_is_read_again():
    """The monitor's ``sample=None`` (forensics' exact statistics) reads the large casts whole: the bound above is
    the sample's doing."""
    extra = _large_reads(None, 0) - _large_reads("off", 0)
    assert sum(extra.values()) > 3


@pytest.mark.parametrize("rowwise", [False, True])
def test_the_sample_is_every_kth_row_cast_with_its_own_scale(rowwise):
    """The underflow of a sampled cast is, exactly, the underflow of every k-th row cast with the scale the whole
    tensor (tensorwise) or that row (rowwise) gets; the amax and the scale are the whole tensor's."""
    torch.manual_seed(3)
    # magnitudes over 40 binades: e4m3fn holds ~18 below its maximum, so a real share of each row underflows
    x = torch.randn(_ROWS, 64) * torch.exp2(-40 * torch.rand(_ROWS, 64))
    k = sample_rows(_ROWS, 64, _SAMPLE)
    assert k == 128 and math.ceil(_ROWS / k) * 64 <= _SAMPLE
    whole = cast_stats(x, torch.float8_e4m3fn, rowwise=rowwise, pow2=False)
    sampled = cast_stats(x, torch.float8_e4m3fn, rowwise=rowwise, pow2=False, sample=_SAMPLE)
    assert torch.equal(whole[:3], sampled[:3])  # the count, the amax and the scale
    rows = x[::k]
    amax = torch.linalg.vector_norm(rows if rowwise else x, ord=math.inf, dim=-1 if rowwise else None,
                                    keepdim=rowwise)
    scale = (torch.finfo(torch.float8_e4m3fn).max / amax.double().clamp(min=1e-12)).float()
    cast = (rows * scale).to(torch.float8_e4m3fn).float()
    expected = ((rows != 0) & (cast == 0)).sum() / rows.numel()
    assert sampled[3].item() == pytest.approx(expected.item(), rel=0, abs=1e-7)
    # an estimate of the whole tensor's fraction
    assert 0.2 < whole[3].item() < 0.8 and abs(sampled[3].item() - whole[3].item()) < 0.05


def test_a_nan_in_a_row_the_sample_skips_still_makes_the_cast_nonfinite():
    """Row 1 is never in the sample (every 128th row: 0, 128, ...): its NaN still reaches the amax and the scale,
    and the monitor's flag."""
    model = _model()
    monitor = Fp8Monitor(model, numerics_every=1)
    monitor.sample = _SAMPLE
    x = torch.randn(_ROWS, 16)
    x[1, 3] = math.nan
    monitor.begin_step(0)
    model(x).square().mean().backward()
    collected = monitor.collect()
    assert monitor.nonfinite(collected).item() == 1.0
    cast = next(c for c in monitor.decode(collected.tolist()) if (c.module, c.role) == ("fc1", "input"))
    assert math.isnan(cast.amax) and not cast.finite


def test_the_default_sample_and_small_tensors():
    """A tensor of at most the sample is read whole (stride 1); the default sample is 2**16 elements (2**20 until
    stop 49, when a sampled step's samples came to share one buffer: 4 MB a cast there); one row of more than the
    sample is the sample (stride = the rows)."""
    assert fp8.SAMPLE_ELEMENTS == 1 << 16 and Fp8Monitor(_model()).sample == fp8.SAMPLE_ELEMENTS
    assert sample_rows(1024, 1024, 1 << 20) == 1 and sample_rows(1025, 1024, 1 << 20) == 2
    assert sample_rows(10, 1 << 21, 1 << 20) == 10 and sample_rows(10, 10, None) == 1


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rowwise, pow2", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("hp", [torch.bfloat16, torch.float32])
def test_the_counted_underflow_is_the_casts_bitwise(dtype, rowwise, pow2, hp):
    """A sampled cast's underflow counts ``|x * scale|`` at most half the fp8 dtype's smallest subnormal
    (``fp8._Sampled``), where :func:`cast_stats` casts and compares with 0: the same row, bitwise, on magnitudes over
    60 binades with zeros, negative zeros, an Inf row, and values either side of each row's threshold (the cast
    rounds to nearest, ties to even)."""
    torch.manual_seed(5)
    x = (torch.randn(64, 48) * torch.exp2(-60 * torch.rand(64, 48) + 10)).to(hp)
    x[0, :4], x[1, :3] = 0.0, -0.0
    x[2, 7] = math.inf
    row_amax = torch.linalg.vector_norm(x, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
    amax = row_amax.amax()
    fmax = torch.finfo(dtype).max
    row_scales = fp8._scale(row_amax if rowwise else amax.reshape(1), fmax, pow2)
    half = fp8._half_tiny(dtype)
    for r in range(3, 64):  # around each row's threshold: half / scale and its neighbours in x's dtype
        scale = row_scales[r if rowwise else 0].item()
        if scale == 0:  # tensorwise with the Inf: every finite value casts to 0
            break
        edge = torch.tensor(half / scale).to(hp)
        up, down = torch.nextafter(edge, torch.tensor(math.inf, dtype=hp)), torch.nextafter(edge, edge.new_zeros(()))
        x[r, 40:43] = torch.stack([edge, up, down])
    row_amax = torch.linalg.vector_norm(x, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
    amax = row_amax.amax()
    row_scales = fp8._scale(row_amax if rowwise else amax.reshape(1), fmax, pow2)
    expected = fp8.cast_stats(x, dtype, rowwise=rowwise, pow2=pow2)
    got = fp8._Sampled.of(x, amax.to(hp), row_scales.amin(), row_scales, dtype).finish()
    assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0)), (got, expected)
    assert 0 < expected[3].item() < 1


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("hp", [torch.bfloat16, torch.float32])
def test_a_nan_scale_counts_no_underflow_as_the_cast_does(rowwise, hp):
    """A NaN in the cast (a NaN gradient: its amax, so its scale, NaN; rowwise that row's) casts every element of it,
    zeros included, to NaN, none to 0: the underflow ``cast_stats`` counts there is 0. Counting the small products
    and subtracting the zeros (``0 * NaN`` is not small) read -(the zeros' fraction): -0.47 on a NaN grad_output
    (``tests/unit/test_fp8_grad_taps.py``). The row of ``fp8._Sampled`` is ``cast_stats``', bitwise."""
    torch.manual_seed(6)
    x = (torch.randn(16, 32) * torch.exp2(-40 * torch.rand(16, 32))).to(hp)
    x[:, ::3] = 0.0
    x[4, 5] = math.nan
    dtype = torch.float8_e4m3fn
    row_amax = torch.linalg.vector_norm(x, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
    amax = torch.where(row_amax.isnan().any(), math.nan, row_amax.amax())
    row_scales = fp8._scale(row_amax if rowwise else amax.reshape(1), torch.finfo(dtype).max, False)
    expected = fp8.cast_stats(x, dtype, rowwise=rowwise, pow2=False)
    got = fp8._Sampled.of(x, amax.to(hp), row_scales.amin(), row_scales, dtype).finish()
    assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0)), (got, expected)
    assert expected[3].item() >= 0 and (expected[3].item() > 0) == rowwise  # rowwise: the other rows underflow


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_two_forwards_in_a_step_keep_the_worst_of_each_cast(recipe):
    """Gradient accumulation: a step of two forwards (a batch of small values, then one of large) reports, per cast,
    the larger amax, underflow and range and the smaller scale of the two forwards measured each in its own step,
    sampled or not."""
    torch.manual_seed(2)
    small, large = torch.randn(64, 16) * 1e-3, torch.randn(64, 16) * 1e3
    small[:, ::3] *= 1e-9  # a third of each row underflows, tensorwise or rowwise
    for step in (0, 1):  # sampled, then not
        model = _model(recipe)
        monitor = Fp8Monitor(model, numerics_every=2)
        alone = []
        for x in (small, large):
            monitor.begin_step(step)
            model(x).square().mean().backward()
            alone.append(monitor.collect())
        monitor.begin_step(step)
        for x in (small, large):
            model(x).square().mean().backward()
        both = monitor.collect()
        monitor.close()
        a, b = alone
        assert torch.equal(both[:, 1], torch.maximum(a[:, 1], b[:, 1]))
        assert torch.equal(both[:, 2], torch.minimum(a[:, 2], b[:, 2]))
        if step == 0:
            assert torch.equal(both[:, 3:], torch.fmax(a[:, 3:], b[:, 3:]))
            assert (a[:, 3] != b[:, 3]).any()
        else:
            assert both[:, 3:].isnan().all()


def test_the_threshold_is_the_largest_magnitude_the_cast_makes_zero():
    """``fp8._thresholds``: for scales over 100 binades, both fp8 dtypes, powers of 2 among them, ``T * scale``
    (float32) is at most half the smallest subnormal and the next float32 above ``T`` is not; a zero scale takes
    every finite value, a NaN scale none but the zeros."""
    torch.manual_seed(4)
    scale = torch.exp2(torch.rand(4000) * 100 - 50)
    scale[::7] = torch.exp2(torch.round(torch.log2(scale[::7])))
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        half = torch.full_like(scale, fp8._half_tiny(dtype))
        bound = fp8._thresholds(scale, half)
        assert (bound * scale <= half).all()
        above = torch.nextafter(bound, torch.full_like(bound, math.inf))
        assert (above * scale > half).all()
        # the cast itself agrees: T casts to 0, the next float32 does not
        assert (((bound * scale).to(dtype).float() == 0) & ((above * scale).to(dtype).float() != 0)).all()
    special = fp8._thresholds(torch.tensor([0.0, math.nan]), torch.full((2,), 2.0**-10))
    assert special[0].item() == torch.finfo(torch.float32).max and special[1].item() == 0.0


@pytest.mark.parametrize("hp", [torch.float32, torch.bfloat16])
def test_the_buffered_samples_give_the_hooks_own_statistics(monkeypatch, hp):
    """A sampled step whose tensorwise casts come through the taps (their samples copied into one buffer, measured
    together) gives every cast's amax, scale, underflow and range as the hooks measure them (``cast_stats``, the
    real cast) where the taps are out of the path: magnitudes over 60 binades, zeros, a NaN in the batch, and a
    batch of more than the sample (every k-th row). The underflow agrees to one float32 step: the hooks divide the
    count by a Python int, the buffer by a tensor."""
    from tests.unit.test_fp8 import spy_over_the_taps

    torch.manual_seed(6)
    x = (torch.randn(_ROWS, 16) * torch.exp2(-60 * torch.rand(_ROWS, 16) + 20)).to(hp)
    x[0, :5] = 0.0
    for bad in (None, math.nan):
        if bad is not None:
            x[7, 3] = bad
        rows = []
        for spied in (False, True):
            model = _model()
            monitor = Fp8Monitor(model, numerics_every=2)
            monitor.sample = _SAMPLE
            if spied:
                spy_over_the_taps(monkeypatch)
            for _ in range(2):  # the first sampled step sizes the buffer; the second fills it
                monitor.begin_step(0)
                model(x).float().square().mean().backward()
                model.zero_grad(set_to_none=True)
                collected = monitor.collect()
            assert (monitor._buffer is None) == spied
            rows.append(collected)
            monitor.close()
            monkeypatch.undo()
        buffered, hooked = rows
        assert torch.equal(buffered[:, :3].nan_to_num(7.0), hooked[:, :3].nan_to_num(7.0))
        assert torch.equal(buffered[:, 4].nan_to_num(7.0), hooked[:, 4].nan_to_num(7.0))
        assert torch.allclose(buffered[:, 3], hooked[:, 3], rtol=2**-23, atol=0, equal_nan=True)
        if bad is None:
            assert (hooked[:, 3] > 0).sum() >= 2, hooked  # both inputs underflow
        else:  # the NaN makes fc1's input amax and scale NaN: no element counts as cast to 0
            assert buffered[0, 1:3].isnan().all() and buffered[0, 3].item() == 0.0


def test_collect_twice_in_a_step_gives_the_same_rows():
    """collect() measures the buffered samples in place (|x|, zeros made Inf), and a second collect() of the same
    sampled step still gives the first one's rows (no zero is then counted, nor counted as cast to 0)."""
    torch.manual_seed(8)
    model = _model()
    monitor = Fp8Monitor(model, numerics_every=2)
    x = torch.randn(64, 16) * torch.exp2(-40 * torch.rand(64, 16))
    x[0, :3] = 0.0
    for _ in range(2):  # the first sampled step sizes the buffer; the second fills it
        monitor.begin_step(0)
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        first, second = monitor.collect(), monitor.collect()
    assert monitor._buffer is not None and torch.equal(first, second)
    monitor.close()


def test_casts_that_outgrow_the_buffer_are_measured_beside_those_in_it(monkeypatch):
    """A batch twice the last sampled step's: the inputs' and grad_outputs' samples no longer fit the buffer (each is
    measured on its own), the weights' still do; together they give the hooks' own statistics, as above."""
    from tests.unit.test_fp8 import spy_over_the_taps

    torch.manual_seed(7)
    small, large = (torch.randn(n, 16) * torch.exp2(-40 * torch.rand(n, 16)) for n in (32, 64))
    rows = []
    for spied in (False, True):
        model = _model()
        monitor = Fp8Monitor(model, numerics_every=2)
        if spied:
            spy_over_the_taps(monkeypatch)
        for x in (small, large):
            monitor.begin_step(0)
            model(x).square().mean().backward()
            model.zero_grad(set_to_none=True)
            if x is large and not spied:
                kinds = [type(s).__name__ for s in monitor._slots]
                assert set(kinds) == {"_Batched", "_Sampled"}, kinds
            collected = monitor.collect()
        rows.append(collected)
        monitor.close()
        monkeypatch.undo()
    mixed, hooked = rows
    assert torch.equal(mixed[:, [0, 1, 2, 4]], hooked[:, [0, 1, 2, 4]])
    assert torch.allclose(mixed[:, 3], hooked[:, 3], rtol=2**-23, atol=0) and (hooked[:, 3] > 0).any()
